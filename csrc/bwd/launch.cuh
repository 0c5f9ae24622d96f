// run_bwd_hdim: D = rowsum(dO * O) and zeroed dQ accumulators, the main
// kernel, then the dQ conversion; one stream, no host synchronisation.
#pragma once
#include "bwd/kernel.cuh"

namespace hf_flash {

template <bool kIsBf16, int kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& params, cudaStream_t stream) {
  using Tr = bwd::Traits<kIsBf16, kHeadDim>;
  const bwd::WorkspaceLayout ws(params);
  auto* base = static_cast<unsigned char*>(params.workspace);
  auto* dsum = reinterpret_cast<float*>(base + ws.dsum_offset);
  auto* dq_acc = reinterpret_cast<float*>(base + ws.dq_offset);
  const int copies = bwd::dq_copies(params);

  cudaError_t err = cudaMemsetAsync(dq_acc, 0, sizeof(float) * ws.dq_copy_floats * copies, stream);
  if (err != cudaSuccess) return err;
  const int64_t row_warps = int64_t(params.total_q) * params.h;
  bwd::dot_do_o_kernel<kIsBf16, kHeadDim>
      <<<(row_warps * 32 + bwd::kThreads - 1) / bwd::kThreads, bwd::kThreads, 0, stream>>>(params, dsum);

  auto* kernel = bwd::main_kernel<kIsBf16, kHeadDim>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(params.deterministic ? copies : bwd::num_n_blocks(params), params.h_k, params.b);
  kernel<<<grid, bwd::kThreads, Tr::kSmemBytes, stream>>>(params, dsum, dq_acc, ws.dq_copy_floats);

  const int64_t chunks = row_warps * (kHeadDim / 8);
  bwd::convert_dq_kernel<kIsBf16, kHeadDim><<<(chunks + bwd::kThreads - 1) / bwd::kThreads, bwd::kThreads, 0, stream>>>(
      params, dq_acc, ws.dq_copy_floats, copies);
  return cudaGetLastError();
}

}  // namespace hf_flash
