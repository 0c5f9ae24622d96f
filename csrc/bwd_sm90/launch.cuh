// Launch of the warp-specialised Hopper backward kernel (kernel_ws.cuh): TMA maps, grid, shared memory.
#pragma once
#include <cstdlib>
#include <cstring>

#include "bwd/config.h"
#include "bwd_sm90/kernel_ws.cuh"
#include "sm90/tma.cuh"

namespace hf_flash {
namespace bwd_sm90 {

// TEMPORARY (branch hopper-bwd-ws, for the A/B on the H100; removed with the losing kernels): which Hopper backward
// runs, from HF_FLASH_BWD_SM90_WS: 0 = kernel.cuh's main_kernel (no warp specialisation), 2 = main_kernel_ws with
// the dQ bulk reductions, else (default) main_kernel_ws with red.global.add.
inline int ws_variant() {
  const char* v = std::getenv("HF_FLASH_BWD_SM90_WS");
  return v && std::strcmp(v, "0") == 0 ? 0 : v && std::strcmp(v, "2") == 0 ? 2 : 1;
}

// cudaErrorNotSupported when the driver cannot describe the tensors to TMA (e.g. strides that are not multiples
// of 16 bytes): run_bwd_hdim then runs the mma.sync kernel.
template <bool kIsBf16, int kHeadDim, bool kDqBulk>
cudaError_t run_main_ws(const BwdParams& p, const float* dsum, float* dq_acc, cudaStream_t stream) {
  using Tr = WsTraits<kIsBf16, kHeadDim, kDqBulk>;
  const bool varlen = p.cu_seqlens_q != nullptr;
  // A varlen tensor is one batch of its total rows.
  const int batches = varlen ? 1 : p.b, rows_q = varlen ? p.total_q : p.seqlen_q;
  const int rows_k = varlen ? p.total_k : p.seqlen_k;
  constexpr int kBlockM = Tr::Tile::kBlockM, kBlockN = Tr::Tile::kBlockN;
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
  auto kernel = &main_kernel_ws<kIsBf16, kHeadDim, kDqBulk>;
  err = allow_smem(kernel, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(bwd::num_n_blocks(p), p.h_k, p.b);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, maps, dsum, dq_acc);
  return cudaSuccess;
}

}  // namespace bwd_sm90
}  // namespace hf_flash
