// Decode launch: the split kernel over (query-row tiles, splits, KV heads x batch), then the combine.
#pragma once
#include "decode/kernel.cuh"
#include "decode/traits.cuh"
#include "flash.h"

namespace hf_flash {

template <bool kIsBf16, int kHeadDim>
cudaError_t run_decode_hdim(const FwdParams& p, cudaStream_t stream) {
  using Tr = DecodeTraits<kIsBf16, kHeadDim>;
  const int rows = p.seqlen_q * (p.h / p.h_k);
  if (rows == 0 || p.b == 0) return cudaSuccess;
  const dim3 grid((rows + Tr::kBlockM - 1) / Tr::kBlockM, p.num_splits, p.b * p.h_k);
  auto kernel = &decode::decode_kernel<Tr>;
  cudaError_t err = allow_smem(kernel, Tr::kSmemBytes);
  if (err == cudaSuccess) err = launch_rel_bias_fill(p, stream);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  if (p.num_splits > 1) {
    decode::combine_kernel<Tr><<<(p.b * p.h * p.seqlen_q + 3) / 4, 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace hf_flash
