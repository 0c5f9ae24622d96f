// Backward tile shape and workspace layout, shared by the host (workspace.cu,
// launch.cuh) and the kernels, so the sizes agree by construction.
#pragma once
#include <algorithm>
#include <cstddef>

#include "flash.h"

namespace hf_flash {
namespace bwd {

constexpr int kThreads = 256;  // 8 warps
// Keys per CTA: 128 up to d128, 64 up to d256, 32 above (dK/dV accumulators and smem: 205 KB at d512).
__host__ __device__ constexpr int block_n(int d) { return d <= 128 ? 128 : d <= 256 ? 64 : 32; }
// Deterministic mode: at most this many private fp32 dQ accumulators.
constexpr int kMaxDqCopies = 8;

inline int num_n_blocks(const BwdParams& p) { return (p.seqlen_k + block_n(p.d) - 1) / block_n(p.d); }

// Number of fp32 dQ accumulators. Non-deterministic: one, every CTA adds into
// it with atomics. Deterministic: CTA "lane" x walks key blocks x, x+copies, ...
// in order and adds only into copy x (a single writer per element), and the
// convert kernel sums the copies in a fixed order.
inline int dq_copies(const BwdParams& p) {
  if (!p.deterministic) return 1;
  const int ctas = std::max(1, p.b * p.h_k);
  const int fill = (std::max(1, p.num_sms) + ctas - 1) / ctas;  // enough lanes for one wave
  return std::max(1, std::min({num_n_blocks(p), fill, kMaxDqCopies}));
}

// A main kernel's dynamic shared memory: its tiles' `tile_bytes`, plus the d rel_bias sums of one query head
// (bwd_common.cuh: RelBiasGrad) where they fit this device's opt-in limit; else p.rel_bias_in_gmem (the kernel adds
// into drel_bias with global atomics: slower, for radii past what shared memory holds).
inline int rel_bias_smem(BwdParams& p, int tile_bytes) {
  const int sums = p.rel_bias ? (2 * p.rel_bias_radius + 1 + 3) / 4 * 16 : 0;
  p.rel_bias_in_gmem = sums > 0 && tile_bytes + sums > smem_optin_bytes();
  return tile_bytes + (p.rel_bias_in_gmem ? 0 : sums);
}

// Workspace: D = rowsum(dO * O) as (h, total_q) floats, then the dQ copies as
// (copy, total_q, h, d) floats, each part 256-byte aligned.
struct WorkspaceLayout {
  size_t dsum_offset, dq_offset, dq_copy_floats, bytes;
  explicit WorkspaceLayout(const BwdParams& p) {
    auto align = [](size_t x) { return (x + 255) / 256 * 256; };
    dsum_offset = 0;
    dq_offset = align(sizeof(float) * size_t(p.h) * p.total_q);
    dq_copy_floats = size_t(p.total_q) * p.h * p.d;
    bytes = dq_offset + align(sizeof(float) * dq_copy_floats * dq_copies(p));
  }
};

}  // namespace bwd
}  // namespace hf_flash
