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
// Deterministic mode: at most this many private fp32 dQ accumulators (mma.sync kernels).
constexpr int kMaxDqCopies = 8;
// Query rows per block of the Hopper backward, its smallest (d64 takes 128): the deterministic mode's dQ-order
// counters are allocated per (batch, query head, block of these rows), enough for every kernel.
constexpr int kSm90BlockM = 64;
// The Hopper backward's query rows a block: 128 at d64 (one pass over both warpgroups' keys), else kSm90BlockM.
__host__ __device__ constexpr int sm90_block_m(int d) { return d == 64 ? 128 : kSm90BlockM; }
// At d64 / d128 it adds dQ in its consumers' own register order, as FlashAttention-3 / 4 do: the accumulator is a
// series of blocks of kDqBlockFloats (a query block's rows x d), one per (query block, head), each the two
// consumer warpgroups' 64 x 64 pieces as thread-linear 16-byte chunks (bwd_sm90/kernel.cuh: store_dq; no bank
// swap, no swizzle), added with one bulk reduction a block; the convert kernel reads rows back out of that order.
// Other head dims and the mma.sync kernels keep (copy, total_q, h, d) rows.
__host__ __device__ constexpr bool sm90_dq_blocked(int d) { return d == 64 || d == 128; }
constexpr int kDqBlockFloats = 128 * 64;
// Whole blocks go to an accumulator nothing zeroes: the first add into a block stores it (bwd_sm90/kernel.cuh;
// the D kernel then zeroes only a counter per block): in deterministic mode the order's first, else the first key
// block to reach it (a compare-and-swap claims the block, the others add once its store is complete).
__host__ __device__ constexpr bool sm90_first_add_stores(int d) { return sm90_dq_blocked(d); }
// Sequence b's first dQ block (`start`: its first row, as seq_rows gives it): dense b ceil(seqlen_q / M); varlen
// its packed block (flash.h: packed_block0).
__host__ __device__ inline int64_t dq_block0(const BwdParams& p, int b, int start, int block_m) {
  return p.cu_seqlens_q ? packed_block0(start, b, block_m) : int64_t(b) * ((p.seqlen_q + block_m - 1) / block_m);
}
inline int64_t dq_blocks(const BwdParams& p, int block_m) {
  return p.cu_seqlens_q ? packed_blocks(p.total_q, p.b, block_m) : int64_t(p.b) * ((p.seqlen_q + block_m - 1) / block_m);
}

// Key blocks of `block` keys (the mma.sync kernels': block_n(p.d); the Hopper kernel passes its own).
inline int num_n_blocks(const BwdParams& p, int block) { return (p.seqlen_k + block - 1) / block; }
inline int num_n_blocks(const BwdParams& p) { return num_n_blocks(p, block_n(p.d)); }

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

// d rel_bias (bwd_common.cuh: RelBiasGrad): the sums of one query head (2R + 1 floats, 16-byte padded) and each
// of the 8 warps' staging rows for its 16 keys x 8 kJ queries: 8 rows of 8 kJ + 15 diagonals, a row stride of
// 5 mod 16 floats (conflict-free stores).
__host__ __device__ constexpr int rel_sums_floats(int radius) { return (2 * radius + 1 + 3) / 4 * 4; }
__host__ __device__ constexpr int rel_scratch_diagonals(int kJ) { return 8 * kJ + 15; }
__host__ __device__ constexpr int rel_scratch_stride(int kJ) {
  return rel_scratch_diagonals(kJ) + (5 - rel_scratch_diagonals(kJ) % 16 + 16) % 16;
}
__host__ __device__ constexpr int rel_scratch_floats(int kJ) { return 8 * 8 * rel_scratch_stride(kJ); }
// Every sm_90 GPU lets a block opt in to 227 KB: each main kernel's traits assert that its tiles, its staging rows
// and the sums of a radius up to 511 fit (so sm_90 code never takes the p.rel_bias_direct path).
constexpr int kSm90SmemOptin = 227 * 1024;
__host__ __device__ constexpr bool rel_bias_fits_sm90(int tile_bytes, int kJ) {
  return tile_bytes + 4 * rel_scratch_floats(kJ) + 4 * rel_sums_floats(511) <= kSm90SmemOptin;
}

// A main kernel's dynamic shared memory: its tiles' `tile_bytes`, plus (with a relative bias) the staging rows of
// its warps' kJ-column tiles and the sums, where they fit this device's opt-in limit. Else the sums go to global
// memory first (p.rel_bias_in_gmem: global atomics), then the staging (p.rel_bias_direct: one add per bin).
// `sums_in_gmem`: the Hopper kernels add into global memory always: a float reduction there is one instruction,
// in shared memory a compare-and-swap loop on sm_90 (4-5% of the t5-base backward at S = 512, none at 4k).
inline int rel_bias_smem(BwdParams& p, int tile_bytes, int kJ, bool sums_in_gmem = false) {
  p.rel_bias_in_gmem = p.rel_bias_direct = false;
  if (!p.rel_bias) return tile_bytes;
  const int sums = 4 * rel_sums_floats(p.rel_bias_radius), staging = 4 * rel_scratch_floats(kJ);
  const int optin = smem_optin_bytes();
  p.rel_bias_in_gmem = sums_in_gmem || tile_bytes + sums + staging > optin;
  p.rel_bias_direct = tile_bytes + staging > optin;
  return tile_bytes + (p.rel_bias_in_gmem ? 0 : sums) + (p.rel_bias_direct ? 0 : staging);
}

// Workspace: D = rowsum(dO * O) as (h, total_q) floats, then the dQ copies as (copy, total_q, h, d) floats, then
// the Hopper backward's dQ counters, each part 256-byte aligned: where the first add stores (sm90_first_add_stores)
// one int per accumulator block (block, head), else in deterministic mode (b, h, ceil(seqlen_q / kSm90BlockM)).
struct WorkspaceLayout {
  size_t dsum_offset, dq_offset, dq_copy_floats, counters_offset, counters, bytes;
  static constexpr size_t align(size_t x) { return (x + 255) / 256 * 256; }
  explicit WorkspaceLayout(const BwdParams& p) {
    dsum_offset = 0;
    dq_offset = align(sizeof(float) * size_t(p.h) * p.total_q);
    dq_copy_floats = size_t(p.total_q) * p.h * p.d;  // rows, or the Hopper kernel's blocks (either may run)
    if (sm90_dq_blocked(p.d)) {
      dq_copy_floats = std::max(dq_copy_floats, size_t(dq_blocks(p, sm90_block_m(p.d))) * p.h * kDqBlockFloats);
    }
    counters_offset = dq_offset + align(sizeof(float) * dq_copy_floats * dq_copies(p));
    counters = sm90_first_add_stores(p.d) ? size_t(dq_blocks(p, sm90_block_m(p.d))) * p.h
               : p.deterministic        ? size_t(p.b) * p.h * ((p.seqlen_q + kSm90BlockM - 1) / kSm90BlockM)
                                        : 0;
    bytes = counters_offset + align(sizeof(int) * counters);
  }
};

}  // namespace bwd
}  // namespace hf_flash
