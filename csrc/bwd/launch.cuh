// The mma.sync backward (sm80+, every head dim and feature): D = rowsum(dO * O) and zeroed dQ accumulators,
// the main kernel, then the dQ conversion; one stream, no host synchronisation.
#pragma once
#include "bwd/kernel.cuh"
#include "bwd/kernel_large_d.cuh"

namespace hf_flash {
namespace bwd {

template <class Tr, class Kernel>
cudaError_t launch_main(Kernel kernel, BwdParams p, const BwdWorkspace& ws, cudaStream_t stream) {
  const int smem = rel_bias_smem(p, Tr::kSmemBytes, Tr::kRelJ);
  const cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.deterministic ? ws.copies : num_n_blocks(p), p.h_k, p.b);
  kernel<<<grid, kThreads, smem, stream>>>(p, ws.dsum, ws.dq_acc, ws.dq_copy_floats);
  return cudaSuccess;
}

}  // namespace bwd

template <bool kIsBf16, int kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream) {
  const bwd::BwdWorkspace ws(p);
  cudaError_t err = bwd::bwd_prologue<kIsBf16, kHeadDim>(p, ws, stream);
  if (err != cudaSuccess) return err;
  // d <= 128: P^T / dS^T feed the dV / dK products from registers; above, through shared memory.
  if constexpr (kHeadDim <= 128) {
    err = bwd::launch_main<bwd::BwdTraits<kIsBf16, kHeadDim>>(bwd::bwd_kernel<kIsBf16, kHeadDim>, p, ws, stream);
  } else {
    err = bwd::launch_main<bwd::BwdLargeDTraits<kIsBf16, kHeadDim>>(bwd::bwd_large_d_kernel<kIsBf16, kHeadDim>, p,
                                                                    ws, stream);
  }
  if (err != cudaSuccess) return err;
  return bwd::bwd_epilogue<kIsBf16, kHeadDim>(p, ws, stream);
}

}  // namespace hf_flash
