// Compile-time shape of the split-KV decode kernel: one CTA per (query-row tile, split, KV head, batch).
#pragma once
#include "attn/fwd_traits.cuh"
#include "flash.h"

namespace hf_flash {

template <bool kIsBf16, int kHeadDim_>
struct DecodeTraits {
  // Each warp is an independent flash-attention worker on the CTA's 16 packed query rows and every
  // kWarps-th block of 16 keys of the split, with its own cp.async pipeline of kStages K/V blocks
  // (no CTA barrier in the main loop). The warps' (max, sum, O) merge through shared memory at the end.
  using Warp = FwdTraits<kIsBf16, kHeadDim_, kDecodeBlockM, 16, 1>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Warp::kBlockM;
  static constexpr int kBlockN = Warp::kBlockN;  // keys per warp step
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // Up to d128 two CTAs fit in shared memory (2 x 100 KB at d128).
  static constexpr int kStages = kHeadDim <= 128 ? 3 : 2;
  static constexpr int kStageBytes = 2 * Warp::kSmemKV;  // K then V
  static constexpr int kSmemStats = 2 * kWarps * kBlockM * 4;  // per-warp row max / sum, fp32
  static constexpr int kOStride = kHeadDim + 4;  // fp32 row stride of the O exchange (spreads banks)
  static constexpr int kSmemKV = kWarps * kStages * kStageBytes;
  static constexpr int kSmemO = kWarps * kBlockM * kOStride * 4;
  static constexpr int kSmemBytes = Warp::kSmemQ + kSmemStats + (kSmemKV > kSmemO ? kSmemKV : kSmemO);
  static_assert(kHeadDim % 32 == 0, "the epilogue moves float4s, 8 threads per row");
};

}  // namespace hf_flash
