// The decode pass: how many key ranges a call splits into. Always compiled. Only as many as it takes to
// saturate HBM: every split adds fp32 partials and a combine kernel, and one CTA on each of half the SMs
// already streams near full bandwidth, so the target is 0.9 x num_sms / 2 CTAs rather than flash-attn's fill
// of whole waves of the GPU (measurements: docs/design/decode.md).
#include <algorithm>

#include "flash.h"

namespace hf_flash {

int decode_num_splits(const FwdParams& p) {
  const int rows = p.seqlen_q * (p.h / p.h_k);
  const int ctas = p.b * p.h_k * ((rows + kDecodeBlockM - 1) / kDecodeBlockM);
  const int target = std::max(1, p.num_sms * 9 / 20);
  const int n_blocks = (p.seqlen_k + kDecodeSplitBlock - 1) / kDecodeSplitBlock;
  const int splits = (target + ctas - 1) / ctas;
  return std::max(1, std::min({splits, n_blocks, kDecodeMaxSplits}));
}

}  // namespace hf_flash
