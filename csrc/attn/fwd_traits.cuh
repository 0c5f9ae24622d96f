// Compile-time shape of one forward kernel instance: which tile each CTA owns
// and how its shared memory is laid out.
#pragma once
#include "tile.cuh"

namespace hf_flash {

template <bool kIsBf16_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kVSplit_ = 1>
struct FwdTraits {
  static constexpr bool kIsBf16 = kIsBf16_;
  using T = typename tile::Elem<kIsBf16>::T;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // keys per main-loop step
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = kNWarps * 32;
  // Above d256 a warp's O accumulator (16 rows x d fp32) does not fit in registers: kVSplit CTAs each own
  // d / kVSplit columns of V and O, and each computes the whole S = Q K^T. VSlice: the V / O tile's shape.
  static constexpr int kVSplit = kVSplit_;
  using VSlice = FwdTraits<kIsBf16, kHeadDim_ / kVSplit_, kBlockM_, kBlockN_, kNWarps_>;

  // Each warp owns kMTiles 16-row slabs of the query tile and all of its keys.
  static constexpr int kMTiles = kBlockM / (16 * kNWarps);
  static constexpr int kNTiles = kBlockN / 8;   // n8 accumulator tiles of S per slab
  static constexpr int kDTiles = kHeadDim / kVSplit / 8;  // n8 accumulator tiles of O per slab

  // Shared-memory rows are padded to a multiple of 128 bytes so the 16-byte
  // XOR swizzle stays inside the row (d32 -> 64 columns, d96 -> 128).
  static constexpr int kSmemCols = (kHeadDim + 63) / 64 * 64;
  static constexpr int kRowBytes = kSmemCols * 2;
  static constexpr int kSmemQ = kBlockM * kRowBytes;  // reused to stage O
  static constexpr int kSmemKV = kBlockN * kRowBytes;
  static constexpr int kSmemBytes = kSmemQ + kSmemKV + kSmemKV / kVSplit;  // Q, K, V (slice): one buffer each

  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp needs whole 16-row slabs");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "mma k-steps are 16 wide");
  static_assert(kVSplit == 1 || kSmemCols == kHeadDim && (kHeadDim / kVSplit) % 64 == 0, "whole 64-column slices");
};

}  // namespace hf_flash
