// Launch of the Hopper backward kernel (kernel.cuh): TMA maps, grid, shared memory.
#pragma once
#include <algorithm>
#include <cstdint>

#include "bwd/config.h"
#include "bwd_sm90/kernel.cuh"
#include "sm90/tma.cuh"

namespace hf_flash {
namespace bwd_sm90 {

// (kv head, batch) pairs per section of the grid (kernel.cuh: key blocks slowest within a section). Causal key
// blocks differ in work (block 0 sees every query block), so a section must hold enough pairs that its light blocks
// can balance its heavy ones across the SMs: heavy block ~ n_blocks units, section ~ pairs * n_blocks^2 / 2 units
// over num_sms, hence 2 * num_sms / n_blocks pairs. Capped so the section's Q, dO (and their dQ) stay a share of
// L2; without causality every block is alike and one pair's blocks in a row share Q, dO in L2 best. On the H100
// (NOTES-sm90.md), over one pair per section: Llama shapes (GQA 16 / 8, d128, causal) 2 x 4k 1.19x, 8 x 1k 1.10x,
// 1 x 16k 1.01x; the paper grid within its noise (+-3%). All pairs in one section: down to 0.6x there.
inline int grid_group(const BwdParams& p, int n_blocks) {
  if (p.window_right != 0) return 1;  // not causal (supported() rules out other windows)
  const int64_t pair_bytes = int64_t(p.h / p.h_k) * p.seqlen_q * p.d * 2 * 2;  // Q and dO, 16-bit
  const int64_t cap = std::max<int64_t>(1, (int64_t(32) << 20) / std::max<int64_t>(1, pair_bytes));
  const int64_t balance = (2 * int64_t(p.num_sms) + n_blocks - 1) / n_blocks;
  const int64_t g = std::min<int64_t>({balance, cap, int64_t(p.h_k) * p.b});
  return int(std::max<int64_t>(1, g));
}

// cudaErrorNotSupported when the driver cannot describe the tensors to TMA (e.g. strides that are not multiples
// of 16 bytes): run_bwd_hdim then runs the mma.sync kernel.
template <bool kIsBf16, int kHeadDim>
cudaError_t run_main(const BwdParams& p, const float* dsum, float* dq_acc, cudaStream_t stream) {
  using Tr = Traits<kIsBf16, kHeadDim>;
  const bool varlen = p.cu_seqlens_q != nullptr;
  // A varlen tensor is one batch of its total rows.
  const int batches = varlen ? 1 : p.b, rows_q = varlen ? p.total_q : p.seqlen_q;
  const int rows_k = varlen ? p.total_k : p.seqlen_k;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  TmaMaps maps;
  cudaError_t err = sm90::make_rows_map(&maps.q, p.q, kIsBf16, p.d, p.h, rows_q, batches, p.q_head_stride,
                                        p.q_row_stride, p.q_batch_stride, kBlockM);
  if (err == cudaSuccess) {
    err = sm90::make_rows_map(&maps.dout, p.dout, kIsBf16, p.d, p.h, rows_q, batches, p.do_head_stride,
                              p.do_row_stride, p.do_batch_stride, kBlockM);
  }
  if (err == cudaSuccess) {
    err = sm90::make_rows_map(&maps.k, p.k, kIsBf16, p.d, p.h_k, rows_k, batches, p.k_head_stride, p.k_row_stride,
                              p.k_batch_stride, kBlockN);
  }
  if (err == cudaSuccess) {
    err = sm90::make_rows_map(&maps.v, p.v, kIsBf16, p.d, p.h_k, rows_k, batches, p.v_head_stride, p.v_row_stride,
                              p.v_batch_stride, kBlockN);
  }
  if (err != cudaSuccess) return err;
  auto kernel = &main_kernel<kIsBf16, kHeadDim>;
  err = allow_smem(kernel, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int n_blocks = bwd::num_n_blocks(p);
  kernel<<<n_blocks * p.h_k * p.b, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, maps, dsum, dq_acc,
                                                                           grid_group(p, n_blocks));
  return cudaSuccess;
}

}  // namespace bwd_sm90
}  // namespace hf_flash
