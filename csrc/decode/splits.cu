// How many key ranges a decode call splits into. Only as many as it takes to saturate HBM: every
// split adds fp32 partials and a combine kernel (a few microseconds). Measured on H100
// (benchmarks/NOTES-decode.md): one CTA on each of half the SMs (4 warps, each with two 8 KB K/V
// blocks in flight) already streams within 1% of the bandwidth of a CTA on every SM, so the target
// is 0.9 x num_sms / 2 CTAs rather than flash-attn's fill of whole waves of the GPU.
#include <algorithm>

#include "decode/traits.cuh"
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
