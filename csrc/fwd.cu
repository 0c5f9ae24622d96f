// The forward pass: which kernel runs a call. Always compiled (also with HF_FLASH_DISABLE_FORWARD, which leaves
// out the kernels and run_fwd), since the backward asks use_sm90 too.
#include <cstdlib>
#include <cstring>

#include "flash.h"
#include "tile.cuh"

namespace hf_flash {

// HF_FLASH_DISABLE_SM90=1 forces the mma.sync kernels on Hopper (read per call, so tests can compare both).
bool use_sm90(const FwdParams& p) {
  const char* off = std::getenv("HF_FLASH_DISABLE_SM90");
  return p.arch == 90 && !(off && std::strcmp(off, "1") == 0);
}

// The Hopper kernel covers dense and varlen attention at kFwdSm90HeadDims, full, causal or within a (sliding)
// window, softcap too; ALiBi, dropout, KV-cache rows (seqused_k) and other head dims run the mma.sync kernel.
bool fwd_sm90_supports(const FwdParams& p) {
  return is_one_of(p.d, kFwdSm90HeadDims) && p.alibi_slopes == nullptr && p.dropout_p == 0.f &&
         p.seqused_k == nullptr && p.leftpad_k == nullptr;
}

static __global__ void rel_bias_fill_kernel(const FwdParams p) {
  tile::grid_launch_dependents();  // the Hopper forward may start: it waits before its first bias read
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < RelBias::padded_entries(p)) RelBias::fill(p, i);
}

cudaError_t launch_rel_bias_fill(const FwdParams& p, cudaStream_t s) {
  if (!p.rel_bias) return cudaSuccess;
  const int64_t n = RelBias::padded_entries(p);
  rel_bias_fill_kernel<<<int((n + 255) / 256), 256, 0, s>>>(p);
  return cudaGetLastError();
}

#ifndef HF_FLASH_DISABLE_FORWARD
cudaError_t run_fwd(const FwdParams& p, cudaStream_t s) {
  const cudaError_t err = launch_rel_bias_fill(p, s);
  if (err != cudaSuccess) return err;
  return run_sm90_or_sm80(use_sm90(p) && fwd_sm90_supports(p), run_fwd_sm90, run_fwd_sm80, p, s);
}
#endif

}  // namespace hf_flash
