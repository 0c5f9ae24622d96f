// Forward attention maths on mma.sync fragments, shared by the forward kernels (fwd, fwd_sm90) and the
// decode kernel: swizzled tile copies, Q K^T and P V on m16n8k16 tiles, each row's key range and
// visibility window, the mask, softcap, the online-softmax step and the LSE.
#pragma once
#include <cmath>

#include "attn/fwd_traits.cuh"
#include "flash.h"
#include "tile.cuh"

namespace hf_flash {
namespace fwd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Tile copies: 8 threads cover one 64-column group of a row (a 16-byte chunk
// each) and kThreads / 8 rows per pass. The rows a thread touches share
// row % 8 when kThreads >= 64, so its swizzled offsets differ by immediates only.
// `thread` < kThreads (the decode kernel's warps copy their own tiles, thread = lane).
template <class Tr>
struct CopyLane {
  static constexpr int kRowsPerPass = Tr::kThreads / 8;
  int row, col;  // first row, column (elements)
  uint32_t smem;
  __device__ __forceinline__ explicit CopyLane(int thread = threadIdx.x)
      : row(thread / 8), col(thread % 8 * 8), smem(tile::swizzle<Tr::kRowBytes>(row, col * 2)) {}
  // Columns past d (d32, d96 pad their shared rows) are never copied or read.
  __device__ __forceinline__ bool has_group(int cg) const { return cg * 64 + col < Tr::kHeadDim; }
};

// Copies kRows x kHeadDim elements into a swizzled tile; rows >= valid_rows and columns >= cols (the
// tensors' head dim: kHeadDim, or in the decode kernel a multiple of 8 up to it) are zero-filled (zero V rows keep P V finite where P
// is 0; zero Q / K columns leave q.k unchanged).
template <class Tr, int kRows>
__device__ __forceinline__ void load_tile(uint32_t smem, const typename Tr::T* gmem, int64_t row_stride,
                                          int valid_rows, int cols, int thread = threadIdx.x) {
  constexpr int kPass = CopyLane<Tr>::kRowsPerPass;
  static_assert(kRows % kPass == 0, "whole passes per tile");
  const CopyLane<Tr> lane(thread);
  const typename Tr::T* src = gmem + lane.row * row_stride + lane.col;
#pragma unroll
  for (int cg = 0; cg < Tr::kSmemCols / 64; ++cg) {
    if (!lane.has_group(cg)) continue;
    const bool col_valid = cg * 64 + lane.col < cols;
#pragma unroll
    for (int rr = 0; rr < kRows / kPass; ++rr) {
      const bool valid = col_valid && lane.row + rr * kPass < valid_rows;
      const uint32_t dst = kPass % 8 == 0
                               ? smem + lane.smem + rr * kPass * Tr::kRowBytes + cg * 128
                               : smem + tile::swizzle<Tr::kRowBytes>(lane.row + rr * kPass, (lane.col + cg * 64) * 2);
      tile::cp_async16(dst, valid ? src + rr * kPass * row_stride + cg * 64 : gmem, valid);
    }
  }
}

// Swizzled addresses of one thread's ldmatrix row: with row % 8 == lane % 8 and
// lane_chunk in {0, 1}, 16-byte chunk 2c + lane_chunk of row + dr (dr % 8 == 0)
// lies at base[c % 4] + (c / 4) * 128 + dr * kRowBytes, so every address in the
// unrolled GEMMs is one of four registers plus an immediate.
template <int kRowBytes>
struct SwizzledRow {
  uint32_t base[4];
  __device__ __forceinline__ SwizzledRow(uint32_t tile_addr, int row, int lane_chunk) {
#pragma unroll
    for (int c = 0; c < 4; ++c) base[c] = tile_addr + tile::swizzle<kRowBytes>(row, (2 * c + lane_chunk) * 16);
  }
  __device__ __forceinline__ uint32_t operator()(int dr, int c) const {
    return base[c % 4] + (c / 4) * 128 + dr * kRowBytes;
  }
};

// S[mi][nt] += Q (this warp's slabs) K^T.
template <class Tr>
__device__ __forceinline__ void gemm_qk(float (&s)[Tr::kMTiles][Tr::kNTiles][4], const SwizzledRow<Tr::kRowBytes>& q,
                                        const SwizzledRow<Tr::kRowBytes>& k) {
#pragma unroll
  for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
    uint32_t a[Tr::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi) tile::ldmatrix_x4(a[mi], q(mi * 16, kk));
#pragma unroll
    for (int np = 0; np < Tr::kNTiles / 2; ++np) {
      uint32_t b[4];
      tile::ldmatrix_x4(b, k(np * 16, kk));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < Tr::kMTiles; ++mi) {
        tile::mma_16816<Tr::kIsBf16>(s[mi][2 * np], a[mi], b0);
        tile::mma_16816<Tr::kIsBf16>(s[mi][2 * np + 1], a[mi], b1);
      }
    }
  }
}

// P as the A operand of P V: the fp32 accumulator layout of S packs into 16-bit
// pairs with no shuffles (k-step kk = n8 tiles 2kk, 2kk+1).
template <class Tr>
__device__ __forceinline__ void pack_p(uint32_t (&a)[Tr::kMTiles][Tr::kBlockN / 16][4],
                                       const float (&p)[Tr::kMTiles][Tr::kNTiles][4]) {
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
      const float(&lo)[4] = p[mi][2 * kk];
      const float(&hi)[4] = p[mi][2 * kk + 1];
      a[mi][kk][0] = tile::pack2<Tr::kIsBf16>(lo[0], lo[1]);
      a[mi][kk][1] = tile::pack2<Tr::kIsBf16>(lo[2], lo[3]);
      a[mi][kk][2] = tile::pack2<Tr::kIsBf16>(hi[0], hi[1]);
      a[mi][kk][3] = tile::pack2<Tr::kIsBf16>(hi[2], hi[3]);
    }
}

// O[mi][dt] += P V.
template <class Tr>
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kMTiles][Tr::kDTiles][4],
                                        const uint32_t (&p)[Tr::kMTiles][Tr::kBlockN / 16][4],
                                        const SwizzledRow<Tr::kRowBytes>& v) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)
#pragma unroll
    for (int dp = 0; dp < Tr::kDTiles / 2; ++dp) {
      uint32_t b[4];
      tile::ldmatrix_x4_trans(b, v(kk * 16, dp));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mi = 0; mi < Tr::kMTiles; ++mi) {
        tile::mma_16816<Tr::kIsBf16>(o[mi][2 * dp], p[mi][kk], b0);
        tile::mma_16816<Tr::kIsBf16>(o[mi][2 * dp + 1], p[mi][kk], b1);
      }
    }
}

// Keys of `batch` as (first row, count). A KV cache (seqused_k) holds rows [leftpad_k, seqused_k) of
// the sequence's rows, clamped to them.
__device__ __forceinline__ int2 key_range(const FwdParams& p, int batch) {
  const int2 rows = seq_rows(p.cu_seqlens_k, batch, p.total_k, p.seqlen_k);
  if (!p.seqused_k) return rows;
  const int end = max(0, min(p.seqused_k[batch], rows.y));
  const int leftpad = p.leftpad_k ? min(max(p.leftpad_k[batch], 0), end) : 0;
  return make_int2(rows.x + leftpad, end - leftpad);
}

// Scores of invisible keys -> -inf. Element (mi, nt, e) is row row_of(mi, e / 2), key n0 + 8 nt + 2t + e % 2.
template <int kMTiles, int kNTiles, class RowOf>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const KeyWindow& w, int n0, int t,
                                           RowOf row_of) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row_of(mi, half);
      const int lo = w.lo(i), hi = w.hi(i);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n0 + nt * 8 + 2 * t + e;
          if (j < lo || j > hi) s[mi][nt][half * 2 + e] = -INFINITY;
        }
    }
}

// Relative position bias on S (unscaled q.k or softcapped scores): s += units * bias, units = log2(e) / scale_log2
// (the bias is a natural-log logit). Element (mi, nt, e) is row row_of(mi, e / 2), key n0 + 8 nt + 2t + e % 2; rows
// [m0, m_last] x keys [n0, n0 + kNTiles * 8) all saturated on one side add one value. Elements on one diagonal read
// one address (the compiler shares the loads). They read the padded table unclamped (RelBias::table_at), each load
// one instruction off a per-row base (the caller's rows span at most kMaxRows), or, kClamped, each column clamped:
// more instructions, but fewer loads in flight at once (with unclamped loads ptxas spilled 184 bytes in the d64
// three-consumer forward, whose 128 registers hold S, O and the loads).
template <int kMaxRows, bool kClamped, int kMTiles, int kNTiles, class RowOf>
__device__ __forceinline__ void add_rel_bias(float (&s)[kMTiles][kNTiles][4], const RelBias& rb, float units,
                                             int m0, int m_last, int n0, int t, RowOf row_of) {
  static_assert(kClamped || kMaxRows - 1 + kNTiles * 8 - 1 <= kRelBiasPad, "a block's diagonals within the padding");
  const int c = rb.block_column(m0, m_last, n0, n0 + kNTiles * 8 - 1);
  if (c >= 0) {
    const float b = units * __ldg(rb.table + c);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][nt][e] += b;
    return;
  }
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    // Row row_of(mi, 1) is 8 below row_of(mi, 0): its diagonals are 8 less, so its loads are the row above's
    // (one base, compile-time offsets: the compiler shares them).
    const int d0 = n0 + 2 * t - row_of(mi, 0);
    const float* bias = rb.table_at(d0);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + e - 8 * half;
          s[mi][nt][half * 2 + e] += units * __ldg(kClamped ? rb.table + rb.column(d0 + c) : bias + c);
        }
  }
}

// A row's normalisation: O = acc * inv and its natural-log LSE, from its max (log2 units) and its sum of
// exp2(x - max). A learned sink (natural-log logit, or nullptr) joins the sum, not the output. A row with no
// visible key gets O = 0 and LSE = the sink (+inf without one).
struct RowNorm {
  float inv, lse;
};
__device__ __forceinline__ RowNorm row_norm(float max2, float sum, const float* sink) {
  if (sum == 0.f) return {0.f, sink ? *sink : INFINITY};
  if (!sink) return {1.f / sum, (max2 + __log2f(sum)) * kLn2};
  const float sink2 = *sink * kLog2e, top = fmaxf(max2, sink2);
  const float scale = exp2f(max2 - top), total = sum * scale + exp2f(sink2 - top);
  return {scale / total, (top + __log2f(total)) * kLn2};
}

// s = softcap * tanh(s * scale_over_cap) on the unscaled scores.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_softcap(float (&s)[kMTiles][kNTiles][4], float softcap, float scale_over_cap) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nt][e] = softcap * tile::fast_tanh(s[mi][nt][e] * scale_over_cap);
}

// Online softmax step on one key block of masked scores: P = exp2(S * scale_log2 - max) in place, the
// row sums rescaled to the new row max; alpha = the factor O must be rescaled by.
// kStaleLog2 > 0: a row keeps its max while the block's exceeds it by at most kStaleLog2 (log2 units), as
// FlashAttention-4 does: P is then at most 2^kStaleLog2 (fp32 sums and O, 16-bit P hold it) and alpha is exactly
// 1, so the caller may skip O's rescale (O and the row sum stay consistent: the final O / sum is unchanged).
template <class Tr, int kStaleLog2 = 0>
__device__ __forceinline__ void softmax_step(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                             float (&row_max)[Tr::kMTiles][2], float (&row_sum)[Tr::kMTiles][2],
                                             float (&alpha)[Tr::kMTiles][2], float scale_log2) {
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = row_max[mi][half];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[mi][nt][half * 2], s[mi][nt][half * 2 + 1]));
      mx = tile::quad_max(mx);
      if constexpr (kStaleLog2 > 0) {  // mx >= the old max; from -inf (nothing seen yet) it always moves
        if ((mx - row_max[mi][half]) * scale_log2 <= float(kStaleLog2)) mx = row_max[mi][half];
      }
      const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;  // fully masked so far: P = 0, no NaN
      alpha[mi][half] = kStaleLog2 > 0 && mx == row_max[mi][half]
                            ? 1.f
                            : tile::fast_exp2(row_max[mi][half] * scale_log2 - max_scaled);
      row_max[mi][half] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = half * 2; e < half * 2 + 2; ++e) {
          s[mi][nt][e] = tile::fast_exp2(fmaf(s[mi][nt][e], scale_log2, -max_scaled));
          sum += s[mi][nt][e];
        }
      row_sum[mi][half] = row_sum[mi][half] * alpha[mi][half] + sum;
    }
}

template <class Tr>
__device__ __forceinline__ void rescale_o(float (&o)[Tr::kMTiles][Tr::kDTiles][4], const float (&alpha)[Tr::kMTiles][2]) {
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][dt][e] *= alpha[mi][e / 2];
}

// softmax_step, then O rescaled.
template <class Tr>
__device__ __forceinline__ void online_softmax(float (&s)[Tr::kMTiles][Tr::kNTiles][4],
                                               float (&row_max)[Tr::kMTiles][2], float (&row_sum)[Tr::kMTiles][2],
                                               float (&o)[Tr::kMTiles][Tr::kDTiles][4], float scale_log2) {
  float alpha[Tr::kMTiles][2];
  softmax_step<Tr>(s, row_max, row_sum, alpha, scale_log2);
  rescale_o<Tr>(o, alpha);
}

}  // namespace fwd
}  // namespace hf_flash
