// Split-KV decode (flash-decoding) on mma.sync tensor cores (sm80+), for a few query rows against a
// long KV cache, where the run time is the time to read the cache once.
//
// GQA packing: the h / h_k query heads that share a KV head fill the rows of one 16-row tile,
// row r = query i * (h / h_k) + head in group, so each K/V block is read once for all of them.
// A CTA owns one such tile, one KV head and one of num_splits ranges of the visible keys; its
// warps take every kWarps-th block of 16 keys (see DecodeTraits) with the forward kernel's tile
// math and online softmax. The masks, softcap, ALiBi and the relative bias follow the forward kernel (bottom-right
// alignment against the row's valid keys). With one split the CTA writes O and the LSE; otherwise
// fp32 partials that combine_kernel merges.
#pragma once
#include <cmath>

#include "attn/fwd_math.cuh"
#include "decode/traits.cuh"
#include "flash.h"
#include "tile.cuh"

namespace hf_flash {
namespace decode {

using fwd::kLn2;
using fwd::kLog2e;

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads) decode_kernel(const __grid_constant__ FwdParams p) {
  using W = typename Tr::Warp;
  using T = typename W::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kWarps = Tr::kWarps, kStages = Tr::kStages;
  constexpr int kD = Tr::kHeadDim, kDTiles = W::kDTiles;

  extern __shared__ __align__(128) char smem[];
  float* s_max = reinterpret_cast<float*>(smem + W::kSmemQ);  // [kWarps][kBlockM], log2 units
  float* s_sum = s_max + kWarps * kBlockM;
  char* s_data = smem + W::kSmemQ + Tr::kSmemStats;  // K/V stages, then the fp32 O exchange
  const uint32_t sQ = tile::smem_u32(smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const uint32_t sKV = tile::smem_u32(s_data) + warp * kStages * Tr::kStageBytes;

  // ---- this CTA's problem ----------------------------------------------------------------
  const int group = p.h / p.h_k;
  const int rows = p.seqlen_q * group;
  const int r0 = blockIdx.x * kBlockM, split = blockIdx.y;
  const int batch = blockIdx.z / p.h_k, head_k = blockIdx.z % p.h_k;
  const int2 keys = fwd::key_range(p, batch);
  const int seqlen_k = keys.y;
  const KeyWindow window(p, p.seqlen_q, seqlen_k);
  const int i_first = r0 / group, i_last = (min(r0 + kBlockM, rows) - 1) / group;
  // This split's share of the visible key blocks, then this warp's: blocks c0 + warp + kWarps * it.
  const int2 blocks = window.key_blocks(i_first, i_last, kBlockN);
  const int blk_begin = blocks.x, blk_end = blocks.y;
  const int per_split = (blk_end - blk_begin + p.num_splits - 1) / p.num_splits;
  const int c0 = blk_begin + split * per_split;
  const int c1 = min(blk_end, c0 + per_split);
  const int n_steps = c0 + warp < c1 ? (c1 - c0 - warp + kWarps - 1) / kWarps : 0;

  const T* k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + int64_t(keys.x) * p.k_row_stride +
               head_k * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + int64_t(keys.x) * p.v_row_stride +
               head_k * p.v_head_stride;
  // Packed row r (within the tile) -> query i and head; rows past `rows` are padding.
  auto query_of = [&](int r) { return (r0 + r) / group; };
  auto head_of = [&](int r) { return head_k * group + (r0 + r) % group; };

  // ---- Q tile: one gather per row (heads of a group are not one stride apart in general) ------
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < kBlockM * kChunks; idx += Tr::kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r0 + r < rows && c * 8 < p.d;  // columns past d: zero (fwd::load_tile)
    const T* src = static_cast<const T*>(p.q) + batch * p.q_batch_stride +
                   int64_t(valid ? query_of(r) : 0) * p.q_row_stride + (valid ? head_of(r) : 0) * p.q_head_stride;
    tile::cp_async16(sQ + tile::swizzle<W::kRowBytes>(r, c * 16), src + c * 8, valid);
  }
  tile::cp_async_commit();

  auto load_step = [&](int it) {
    const int n0 = (c0 + warp + it * kWarps) * kBlockN;
    const uint32_t sk = sKV + it % kStages * Tr::kStageBytes;
    fwd::load_tile<W, kBlockN>(sk, k + n0 * p.k_row_stride, p.k_row_stride, seqlen_k - n0, p.d, lane);
    fwd::load_tile<W, kBlockN>(sk + W::kSmemKV, v + n0 * p.v_row_stride, p.v_row_stride, seqlen_k - n0, p.d,
                               lane);
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; ++it) {
    if (it < n_steps) load_step(it);
    tile::cp_async_commit();  // empty groups keep the wait counts uniform
  }
  tile::cp_async_wait<kStages - 1>();
  __syncthreads();  // Q landed (every thread's part)

  // Per accumulator row (half = 0: row g, 1: row g + 8): visible keys [lo, hi], ALiBi slope.
  const float scale_log2 = p.softmax_scale_log2;
  const bool has_softcap = p.softcap > 0.f;
  const float scale_over_cap = has_softcap ? p.softmax_scale / p.softcap : 0.f;
  int lo[2], hi[2], qi[2];
  float alibi[2];
  const RelBias rb0(p, 0, p.seqlen_q, seqlen_k);  // shift and width; each row's head picks its table
  const float* rel_table[2];
  const float rel_units = kLog2e / scale_log2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8;
    const bool valid = r0 + r < rows;
    qi[half] = query_of(r);
    lo[half] = valid ? window.lo(qi[half]) : seqlen_k;
    hi[half] = valid ? window.hi(qi[half]) : -1;
    alibi[half] = p.alibi_slopes && valid
                      ? p.alibi_slopes[batch * p.alibi_batch_stride + head_of(r)] * kLog2e / scale_log2
                      : 0.f;
    rel_table[half] = RelBias::head_table(p, valid ? head_of(r) : 0);
  }
  const bool has_alibi = p.alibi_slopes != nullptr;

  const fwd::SwizzledRow<W::kRowBytes> q_frag(sQ, lane & 15, lane >> 4);
  float o[1][kDTiles][4] = {};
  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};

  for (int it = 0; it < n_steps; ++it) {
    __syncwarp();  // every lane is done with the stage the next load overwrites (step it - 1's)
    if (it + kStages - 1 < n_steps) load_step(it + kStages - 1);
    tile::cp_async_commit();
    tile::cp_async_wait<kStages - 1>();
    __syncwarp();  // step it's K/V landed for every lane
    const int n0 = (c0 + warp + it * kWarps) * kBlockN;
    const uint32_t sk = sKV + it % kStages * Tr::kStageBytes, sv = sk + W::kSmemKV;
    const fwd::SwizzledRow<W::kRowBytes> k_frag(sk, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const fwd::SwizzledRow<W::kRowBytes> v_frag(sv, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);

    float s[1][W::kNTiles][4] = {};
    fwd::gemm_qk<W>(s, q_frag, k_frag);
    if (has_softcap) fwd::apply_softcap(s, p.softcap, scale_over_cap);
#pragma unroll
    for (int nt = 0; nt < W::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1, j = n0 + nt * 8 + 2 * t + (e & 1);
        if (has_alibi) s[0][nt][e] -= alibi[half] * float(abs(qi[half] + window.diag - j));
        if (rel_table[0]) s[0][nt][e] += rel_units * __ldg(rel_table[half] + rb0.column(j - qi[half]));
        if (j < lo[half] || j > hi[half]) s[0][nt][e] = -INFINITY;
      }
    fwd::online_softmax<W>(s, row_max, row_sum, o, scale_log2);
    uint32_t p_frag[1][kBlockN / 16][4];
    fwd::pack_p<W>(p_frag, s);
    fwd::gemm_pv<W>(o, p_frag, v_frag);
  }

  // ---- merge the warps: O = sum_w f_w O_w / sum_w f_w l_w, f_w = exp2(m_w - max_w m_w) ----------
  tile::cp_async_wait<0>();
  __syncthreads();  // every warp is done with its K/V stages: reuse them for the fp32 O exchange
  float* s_o = reinterpret_cast<float*>(s_data);  // [kWarps][kBlockM][kOStride]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8;
    const float l = tile::quad_sum(row_sum[0][half]);
    if (t == 0) {
      s_max[warp * kBlockM + r] = row_max[0][half] == -INFINITY ? -INFINITY : row_max[0][half] * scale_log2;
      s_sum[warp * kBlockM + r] = l;
    }
    float* dst = s_o + (warp * kBlockM + r) * Tr::kOStride + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[0][dt][half * 2], o[0][dt][half * 2 + 1]);
  }
  __syncthreads();

  // 8 threads per row, kD / 8 columns each.
  constexpr int kCols = kD / 8;
  const int r = threadIdx.x / 8, col = threadIdx.x % 8 * kCols;
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s_max[w * kBlockM + r]);
  float f[kWarps], l = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    f[w] = m == -INFINITY ? 0.f : tile::fast_exp2(s_max[w * kBlockM + r] - m);
    l += f[w] * s_sum[w * kBlockM + r];
  }
  if (r0 + r >= rows) return;
  const int i = query_of(r), head = head_of(r);
  // One split: the final normalisation (with the sink); several: this range's partial, the sink joins in combine.
  const float* sink = p.sinks && p.num_splits == 1 ? p.sinks + head : nullptr;
  const fwd::RowNorm n = fwd::row_norm(m, l, sink);
  const float inv = n.inv, lse = n.lse;
  float4 acc[kCols / 4];
#pragma unroll
  for (int c = 0; c < kCols / 4; ++c) {
    acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(s_o + (w * kBlockM + r) * Tr::kOStride + col + 4 * c);
      acc[c].x += f[w] * x.x; acc[c].y += f[w] * x.y; acc[c].z += f[w] * x.z; acc[c].w += f[w] * x.w;
    }
    acc[c].x *= inv; acc[c].y *= inv; acc[c].z *= inv; acc[c].w *= inv;
  }
  if (p.num_splits == 1) {
    T* out = static_cast<T*>(p.o) + batch * p.o_batch_stride + int64_t(i) * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
    for (int c = 0; c < kCols / 4; ++c) {
      if (col + 4 * c >= p.d) break;
      *reinterpret_cast<uint2*>(out + col + 4 * c) = make_uint2(tile::pack2<W::kIsBf16>(acc[c].x, acc[c].y),
                                                                tile::pack2<W::kIsBf16>(acc[c].z, acc[c].w));
    }
    if (col == 0) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + i] = lse;
  } else {
    const int64_t row = ((int64_t(split) * p.b + batch) * p.h + head) * p.seqlen_q + i;
#pragma unroll
    for (int c = 0; c < kCols / 4; ++c) {  // rows of d floats
      if (col + 4 * c >= p.d) break;
      *reinterpret_cast<float4*>(p.o_accum + row * p.d + col + 4 * c) = acc[c];
    }
    if (col == 0) p.lse_accum[row] = l == 0.f ? -INFINITY : lse;  // -inf: the combine gives this range weight 0
  }
}

// Merges the splits' partials: one warp per output row (batch, head, query).
template <class Tr>
__global__ void __launch_bounds__(128) combine_kernel(const __grid_constant__ FwdParams p) {
  using T = typename Tr::Warp::T;
  __shared__ float s_weight[4][kDecodeMaxSplits];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int rows = p.b * p.h * p.seqlen_q;  // (b, h, seqlen_q) fp32 rows of one split
  const int row = blockIdx.x * 4 + warp;
  if (row >= rows) return;
  const int i = row % p.seqlen_q, head = row / p.seqlen_q % p.h, batch = row / (p.seqlen_q * p.h);

  float m = -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.lse_accum[s * rows + row]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
  float sum = 0.f;
  for (int s = lane; s < p.num_splits; s += 32) {
    const float w = m == -INFINITY ? 0.f : __expf(p.lse_accum[s * rows + row] - m);
    s_weight[warp][s] = w;
    sum += w;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  __syncwarp();
  const fwd::RowNorm n = fwd::row_norm(m * kLog2e, sum, p.sinks ? p.sinks + head : nullptr);  // no key: O = 0
  const float inv = n.inv;
  T* out = static_cast<T*>(p.o) + batch * p.o_batch_stride + int64_t(i) * p.o_row_stride + head * p.o_head_stride;
  for (int c = lane * 4; c < p.d; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = s_weight[warp][s];
      const float4 x = *reinterpret_cast<const float4*>(p.o_accum + (int64_t(s) * rows + row) * p.d + c);
      acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
    }
    *reinterpret_cast<uint2*>(out + c) = make_uint2(tile::pack2<Tr::Warp::kIsBf16>(acc.x * inv, acc.y * inv),
                                                    tile::pack2<Tr::Warp::kIsBf16>(acc.z * inv, acc.w * inv));
  }
  if (lane == 0) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + i] = n.lse;
}

}  // namespace decode
}  // namespace hf_flash
