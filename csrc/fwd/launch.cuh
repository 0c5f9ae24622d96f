// Forward launch: the tile configuration per head dim, grid and shared memory.
#pragma once
#include "flash.h"
#include "fwd/kernel.cuh"

namespace hf_flash {

// One CTA per (query block, head, batch); fwd_kernel walks the query blocks in
// reverse so the longest causal rows start first.
template <class Tr>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  const dim3 grid((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, p.h * Tr::kVSplit, p.b);
  if (grid.x == 0 || p.b == 0) return cudaSuccess;
  auto kernel = &fwd::fwd_kernel<Tr>;
  const cudaError_t err = allow_smem(kernel, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Tiles (query rows x keys, warps) per head dim, the fastest spill-free ones on the H100; d64 takes 128 keys
// per step (half the per-step overhead of 64; docs/design/forward-sm90.md). Above d256, V / O in 256-column
// slices, one CTA each (d512: 160 KB of shared memory, the d256 kernel's registers).
template <bool kIsBf16, int kHeadDim>
using FwdTraitsFor = FwdTraits<kIsBf16, kHeadDim, kHeadDim <= 128 ? 128 : 64, kHeadDim == 64 ? 128 : 64, 4,
                               (kHeadDim > 256 ? kHeadDim / 256 : 1)>;

template <bool kIsBf16, int kHeadDim>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd<FwdTraitsFor<kIsBf16, kHeadDim>>(p, stream);
}

}  // namespace hf_flash
