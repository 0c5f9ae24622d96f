// run_bwd_hdim: D = rowsum(dO * O) and zeroed dQ accumulators, the main
// kernel (Hopper wgmma where bwd_sm90::supported, else mma.sync), then the dQ
// conversion; one stream, no host synchronisation.
#pragma once
#include "bwd/kernel.cuh"
#include "bwd/kernel_v1.cuh"
#include "bwd_sm90/launch.cuh"

namespace hf_flash {
namespace bwd {

template <class Kernel>
cudaError_t launch_main(Kernel kernel, int smem_bytes, const BwdParams& params, int copies, float* dsum,
                        float* dq_acc, size_t copy_floats, cudaStream_t stream) {
  const cudaError_t attr = allow_smem(kernel, smem_bytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(params.deterministic ? copies : num_n_blocks(params), params.h_k, params.b);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(params, dsum, dq_acc, copy_floats);
  return cudaSuccess;
}

}  // namespace bwd

template <bool kIsBf16, int kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& params, cudaStream_t stream) {
  const bwd::WorkspaceLayout ws(params);
  auto* base = static_cast<unsigned char*>(params.workspace);
  auto* dsum = reinterpret_cast<float*>(base + ws.dsum_offset);
  auto* dq_acc = reinterpret_cast<float*>(base + ws.dq_offset);
  const int copies = bwd::dq_copies(params);

  cudaError_t err = cudaMemsetAsync(dq_acc, 0, sizeof(float) * ws.dq_copy_floats * copies, stream);
  if (err != cudaSuccess) return err;
  const int64_t row_warps = int64_t(params.total_q) * params.h;
  constexpr int kDotLanes = bwd::dot_lanes(kHeadDim);
  bwd::dot_do_o_kernel<kIsBf16, kHeadDim>
      <<<(row_warps * kDotLanes + bwd::kThreads - 1) / bwd::kThreads, bwd::kThreads, 0, stream>>>(params, dsum);

  err = cudaErrorNotSupported;  // until a Hopper kernel takes the call
  if constexpr (kHeadDim == 64 || kHeadDim == 128) {
    if (bwd_sm90::supported<kIsBf16, kHeadDim>(params)) {  // Hopper wgmma kernels for the cases they cover
      err = bwd_sm90::run_main<kIsBf16, kHeadDim>(params, dsum, dq_acc, stream);
    }
  }
  if (err == cudaErrorNotSupported) {  // mma.sync kernels: other GPUs and features, or tensors TMA cannot describe
    if constexpr (kHeadDim <= 128) {
      using Tr = bwd::Traits<kIsBf16, kHeadDim>;
      err = bwd::launch_main(bwd::main_kernel<kIsBf16, kHeadDim>, Tr::kSmemBytes, params, copies, dsum, dq_acc,
                             ws.dq_copy_floats, stream);
    } else {
      using Tr = bwd::TraitsV1<kIsBf16, kHeadDim>;
      err = bwd::launch_main(bwd::main_kernel_v1<kIsBf16, kHeadDim>, Tr::kSmemBytes, params, copies, dsum, dq_acc,
                             ws.dq_copy_floats, stream);
    }
  }
  if (err != cudaSuccess) return err;

  const int64_t chunks = row_warps * (kHeadDim / 8);
  bwd::convert_dq_kernel<kIsBf16, kHeadDim><<<(chunks + bwd::kThreads - 1) / bwd::kThreads, bwd::kThreads, 0, stream>>>(
      params, dq_acc, ws.dq_copy_floats, copies);
  return cudaGetLastError();
}

}  // namespace hf_flash
