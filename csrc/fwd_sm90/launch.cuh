// Hopper forward launch: TMA maps, grid and shared memory of fwd_sm90_kernel per (dtype, head dim).
#pragma once
#include <algorithm>

#include "flash.h"
#include "fwd_sm90/kernel.cuh"
#include "sm90/schedule.cuh"
#include "sm90/tma.cuh"

namespace hf_flash {

// cudaErrorNoKernelImageForDevice when this build carries no sm_90a code for the kernel, and
// cudaErrorNotSupported when the driver cannot describe the tensors to TMA (e.g. broadcast strides):
// run_fwd then runs the mma.sync kernel.
template <class Tr>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  constexpr bool kIsBf16 = Tr::kIsBf16;
  auto kernel = &fwd_sm90::fwd_sm90_kernel<Tr>;
  static const bool has_sm90a = sm90::has_sm90a_code(kernel);
  if (!has_sm90a) return cudaErrorNoKernelImageForDevice;
  const int m_blocks = (p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  if (m_blocks == 0 || p.b == 0) return cudaSuccess;
  // One CTA a tile: sections of (head, batch) pairs, longest causal tiles first; persistent: one CTA an SM over
  // couples of tiles, or with few couples over all tiles heaviest first (sm90/schedule.cuh). A pair's tiles share
  // its K and V. Packed rows: a head's packed blocks in place of (head, batch) pairs' query blocks (kernel.cuh).
  const bool varlen = p.cu_seqlens_q != nullptr, packed = Tr::kTakesPacked && varlen;
  const int64_t blocks = packed ? packed_blocks(p.total_q, p.b, Tr::kBlockM) : m_blocks;
  const int64_t pairs = int64_t(p.h) * (packed ? 1 : p.b), tiles = blocks * pairs;
  const int64_t couples = sm90::FoldedTiles(m_blocks).couples * pairs;
  if constexpr (Tr::kPersistent && !Tr::kSnake) {
    if (sm90::snake_deal(couples, p.num_sms)) return launch_fwd_sm90<typename Tr::Snaked>(p, stream);
  }
  const unsigned grid = unsigned(Tr::kPersistent ? std::min<int64_t>(Tr::kSnake ? tiles : couples, p.num_sms) : tiles);
  // Every tile streams its pair's K / V, so a section holds at most 8 MiB of them: d128 causal 16k (8 MiB a pair)
  // measured 0.94-0.96x / 0.98x with 3 / 2 pairs a section, Llama 2 x 4096 (2 MiB) 1.04-1.11x with 8-9.
  const int group = Tr::kPersistent ? 1
                                    : sm90::section_group(p.window_right == 0, int(pairs), int(blocks), p.num_sms,
                                                          int64_t(p.seqlen_k) * p.d * 2 * 2, int64_t(8) << 20);

  // Maps over (d, heads, rows, batch); a varlen tensor is one batch of its total rows.
  auto make_map = [&](CUtensorMap* map, const void* ptr, int heads, int rows, int64_t head_stride,
                      int64_t row_stride, int64_t batch_stride, int box_rows) {
    return sm90::make_rows_map(map, ptr, sm90::tma_elem(kIsBf16), p.d, heads, rows, varlen ? 1 : p.b, head_stride, row_stride,
                               batch_stride, box_rows);
  };
  fwd_sm90::TmaMaps maps;
  cudaError_t err = make_map(&maps.q, p.q, p.h, varlen ? p.total_q : p.seqlen_q, p.q_head_stride, p.q_row_stride,
                             p.q_batch_stride, Tr::kBlockM);
  if (err == cudaSuccess) {
    err = make_map(&maps.k, p.k, p.h_k, varlen ? p.total_k : p.seqlen_k, p.k_head_stride, p.k_row_stride,
                   p.k_batch_stride, Tr::kBlockN);
  }
  if (err == cudaSuccess) {
    err = make_map(&maps.v, p.v, p.h_k, varlen ? p.total_k : p.seqlen_k, p.v_head_stride, p.v_row_stride,
                   p.v_batch_stride, Tr::kBlockN);
  }
  if (err != cudaSuccess) return err;
  err = allow_smem(kernel, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  // With a bias, the dependent of its table's fill (launch_rel_bias_fill): set up and load under it.
  return launch_kernel(kernel, grid, Tr::kThreads, Tr::kSmemBytes, stream, LaunchAttrs(p.rel_bias != nullptr), p,
                       maps, group);
}

// d64 runs 192-row CTAs (three consumer warpgroups) except causal attention over at most 1k query rows, where
// the coarser blocks cover more of the masked triangle: same-process A/B against 128-row CTAs, 0.92x at causal
// 1k and 1.03-1.13x at causal 2k / 16k and non-causal 1k / 16k (docs/design/forward-sm90.md). The persistent
// two-consumer CTAs below take d64 causal up to 2k keys and full attention up to 1k: against the 192-row CTAs
// causal 2k 1.02x, full 1k 1.04x, full 2k 0.92x.
// Full and causal attention over dense tensors with up to kPersistentKeys keys runs persistent CTAs (two
// consumers): a tile of few key blocks would otherwise wait for its Q and first K / V with nothing to overlap them.
// Causal tiles go in couples of equal work (sm90/schedule.cuh); dealt one by one round-robin they lost 1-6%. Where
// the couples' last round would leave SMs idle, all tiles go heaviest first in a snake (SnakeTiles): the SmolLM2
// layer (9 / 3 heads, d64, causal) at 8 x 1024 1.21x, 16 x 512 1.12x (same-process A/B, H100).
// Same-process A/B: d128 full 1k / 2k 1.08x / 1.05x, causal 1k / 2k 1.14x / 1.08x, Llama 8 x 1024 1.18x, d64
// causal 1k 1.14x (docs/design/forward-sm90.md). Windowed and KV-cache rows keep one CTA a tile, packed rows too
// but at d128 (below). Three
// persistent consumers (160 registers) measured 0.84-1.00x the kernels used here at d64 up to 2k keys.
constexpr int kPersistentKeys = 2048, kPersistentKeysD64Full = 1024;
template <bool kIsBf16, int kHeadDim, Scores kScores>
cudaError_t run_fwd_sm90_shape(const FwdParams& p, cudaStream_t stream) {
  // Tiles whose work is equal (full attention) or falls linearly with the query block (causal): couples balance.
  const bool causal = p.window_right == 0;
  const bool linear_work = p.window_left < 0 && p.window_right <= 0 && !p.cu_seqlens_q && !p.seqused_k;
  if constexpr (kHeadDim <= 128) {  // d256 has no room for a second Q buffer
    using Persistent = fwd_sm90::FwdSm90Traits<kIsBf16, kHeadDim, 2, true, kScores>;
    if (linear_work && p.seqlen_k <= (kHeadDim == 64 && !causal ? kPersistentKeysD64Full : kPersistentKeys)) {
      return launch_fwd_sm90<Persistent>(p, stream);
    }
    // Packed rows without a window at d128: every (head, packed block), each sequence's last first, in a snake
    // over persistent CTAs. Against one CTA a tile (same-process A/B, H100), 8 packed documents 1.022x at d128,
    // 0.970x at d64 (there the 192-row CTAs stay).
    if constexpr (Persistent::Snaked::kTakesPacked) {
      if (p.cu_seqlens_q && !p.seqused_k && p.window_left < 0 && p.window_right <= 0) {
        return launch_fwd_sm90<typename Persistent::Snaked>(p, stream);
      }
    }
  }
  if constexpr (kHeadDim == 64 && kScores != Scores::kSoftcap) {  // softcap at d64: two consumers
    if (!causal || p.seqlen_q > 1024) {
      return launch_fwd_sm90<fwd_sm90::FwdSm90Traits<kIsBf16, 64, 3, false>>(p, stream);
    }
  }
  return launch_fwd_sm90<fwd_sm90::FwdSm90Traits<kIsBf16, kHeadDim, 2, false, kScores>>(p, stream);
}
// The two-consumer kernels hold one walk each: plain, with T5's relative bias or with softcap. With the first two
// (chosen at run time) the d128 persistent kernel was 7672 SASS instructions against 4144, and at S = 512 its
// warps lost 6-8% of their samples waiting for instructions (cuDNN 1.4%); split, S = 512 ran 1.00-1.02x. The d64
// three-consumer kernel keeps plain and bias: with one, ptxas spilled in its epilogue and it ran 0.95-0.97x
// (docs/design/forward-sm90.md).
template <bool kIsBf16, int kHeadDim>
cudaError_t run_fwd_sm90_hdim(const FwdParams& p, cudaStream_t stream) {
  return run_for_scores(p, [&](auto scores) {
    return run_fwd_sm90_shape<kIsBf16, kHeadDim, decltype(scores)::value>(p, stream);
  });
}

}  // namespace hf_flash
