// The backward pass: its workspace and which kernel runs a call, chosen once as in the forward (csrc/fwd.cu).
// Always compiled; HF_FLASH_DISABLE_BACKWARD leaves out the kernels and run_bwd.
#include "attn/bwd_config.h"
#include "flash.h"

namespace hf_flash {

size_t bwd_workspace_bytes(const BwdParams& p) { return bwd::WorkspaceLayout(p).bytes; }

// The Hopper kernel covers kBwdSm90HeadDims, dense and varlen, full, causal or within a (sliding) window, with a
// relative bias or softcap or neither, deterministic or not (d512: plain and not deterministic); ALiBi, dropout
// and other head dims run the mma.sync kernels.
bool bwd_sm90_supports(const BwdParams& p) {
  if (bwd_sm90_splits_d(p.d) && p.rel_bias) return false;  // (flash.h says why)
  if (p.d == 512 && (p.softcap > 0.f || p.deterministic)) return false;  // the cluster kernel's one instance
  return is_one_of(p.d, kBwdSm90HeadDims) && !p.alibi_slopes && p.dropout_p <= 0.f;
}

#ifndef HF_FLASH_DISABLE_BACKWARD
cudaError_t run_bwd(const BwdParams& p, cudaStream_t s) {
  return run_sm90_or_sm80(use_sm90(p) && bwd_sm90_supports(p), run_bwd_sm90, run_bwd_sm80, p, s);
}
#endif

}  // namespace hf_flash
