// FlashAttention-2 forward on mma.sync tensor cores (sm80+).
//
// One CTA owns kBlockM query rows of one (batch, head) and walks the visible
// key blocks from the last to the first (the masked diagonal block comes
// first, so later blocks skip masking). Per key block:
//   S = Q K^T (fp32) -> softcap / ALiBi / relative bias / mask -> online softmax in the exp2
//   domain -> (dropout) -> O += P V with P packed from S's registers.
// O stays unnormalised until the end; the natural-log LSE goes out in fp32.
// Shared memory holds one Q, one K and one V tile, XOR-swizzled; cp.async
// loads V during Q K^T and the next K during softmax and P V. Above d256, each
// of Tr::kVSplit CTAs owns a slice of V's and O's columns (FwdTraits).
#pragma once
#include "attn/fwd_math.cuh"

namespace hf_flash {
namespace fwd {

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads) fwd_kernel(const __grid_constant__ FwdParams p) {
  using T = typename Tr::T;
  using TV = typename Tr::VSlice;  // V / O columns of this CTA
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim;  // exact head dim (dispatch)
  constexpr int kMTiles = Tr::kMTiles, kNTiles = Tr::kNTiles, kDTiles = Tr::kDTiles, kDV = TV::kHeadDim;

  extern __shared__ __align__(128) char smem[];
  const uint32_t sQ = tile::smem_u32(smem), sK = sQ + Tr::kSmemQ, sV = sK + Tr::kSmemKV;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;  // accumulator row / column pair within an mma tile
  // ldmatrix rows: A = Q rows 0-15 x k 0-7 / 8-15; B = K keys 0-7 / 8-15 (two n8 tiles) x k 0-7 / 8-15;
  // B^T = V keys 0-7 / 8-15 x dims 0-7 / 8-15 (two n8 tiles).
  const SwizzledRow<Tr::kRowBytes> q_frag(sQ, warp * kMTiles * 16 + (lane & 15), lane >> 4);
  const SwizzledRow<Tr::kRowBytes> k_frag(sK, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
  const SwizzledRow<TV::kRowBytes> v_frag(sV, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);

  // ---- this CTA's problem --------------------------------------------------------
  const int m_block = gridDim.x - 1 - blockIdx.x;  // longest causal rows first
  const int head = blockIdx.y / Tr::kVSplit, v_col = blockIdx.y % Tr::kVSplit * kDV, batch = blockIdx.z;
  const int2 rows_q = seq_rows(p.cu_seqlens_q, batch, p.total_q, p.seqlen_q);
  const int q_start = rows_q.x, seqlen_q = rows_q.y;
  const int2 keys = key_range(p, batch);
  const int k_start = keys.x, seqlen_k = keys.y;
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen_q) return;

  const KeyWindow w(p, seqlen_q, seqlen_k);
  const int m_last = min(m0 + kBlockM, seqlen_q) - 1;
  const int2 blocks = w.key_blocks(m0, m_last, kBlockN);
  const int n_block_min = blocks.x, n_block_max = blocks.y;

  const int head_k = head / (p.h / p.h_k);
  const T* q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + int64_t(q_start + m0) * p.q_row_stride +
               head * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + int64_t(k_start) * p.k_row_stride +
               head_k * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + int64_t(k_start) * p.v_row_stride +
               head_k * p.v_head_stride + v_col;

  load_tile<Tr, kBlockM>(sQ, q, p.q_row_stride, seqlen_q - m0, kD);
  if (n_block_max > n_block_min) {
    const int n0 = (n_block_max - 1) * kBlockN;
    load_tile<Tr, kBlockN>(sK, k + n0 * p.k_row_stride, p.k_row_stride, seqlen_k - n0, kD);
  }
  tile::cp_async_commit();

  // Rarely used features, all uniform branches.
  const float scale_log2 = p.softmax_scale_log2;
  const bool has_softcap = p.softcap > 0.f;
  const float scale_over_cap = has_softcap ? p.softmax_scale / p.softcap : 0.f;
  // ALiBi bias in the units of S before scaling: slope * log2(e) / scale_log2.
  const float alibi = p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * kLog2e / scale_log2 : 0.f;
  const RelBias rb(p, head, seqlen_q, seqlen_k);
  const bool has_dropout = p.dropout_p > 0.f;
  const uint64_t seed = has_dropout ? uint64_t(p.rng_state[0]) : 0;
  const uint32_t rng_offset = has_dropout ? uint32_t(p.rng_state[1]) : 0;

  // Row (within the sequence) of accumulator element e of slab mi: half = e / 2.
  const int row0 = m0 + warp * kMTiles * 16 + g;
  auto row_of = [&](int mi, int half) { return row0 + mi * 16 + half * 8; };

  float o[kMTiles][kDTiles][4] = {};
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
    const int n0 = n_block * kBlockN;
    tile::cp_async_wait<0>();
    __syncthreads();  // K (and Q) landed; every warp is done with the previous V
    load_tile<TV, kBlockN>(sV, v + n0 * p.v_row_stride, p.v_row_stride, seqlen_k - n0, kDV);
    tile::cp_async_commit();

    float s[kMTiles][kNTiles][4] = {};
    gemm_qk<Tr>(s, q_frag, k_frag);

    tile::cp_async_wait<0>();
    __syncthreads();  // V landed; every warp is done with K
    if (n_block > n_block_min) {
      load_tile<Tr, kBlockN>(sK, k + (n0 - kBlockN) * p.k_row_stride, p.k_row_stride, seqlen_k - n0 + kBlockN, kD);
    }
    tile::cp_async_commit();

    // ---- scores: softcap, ALiBi, relative bias, mask (S is still q.k, unscaled) ----
    if (has_softcap) apply_softcap(s, p.softcap, scale_over_cap);
    if (alibi != 0.f) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + nt * 8 + 2 * t + (e & 1);
            s[mi][nt][e] -= alibi * float(abs(row_of(mi, e >> 1) + w.diag - j));
          }
    }
    if (rb.table) add_rel_bias<kBlockM, false>(s, rb, kLog2e / scale_log2, m0, m_last, n0, t, row_of);
    if (!w.covers(m0, m_last, n0, n0 + kBlockN - 1)) apply_mask(s, w, n0, t, row_of);

    online_softmax<Tr>(s, row_max, row_sum, o, scale_log2);

    // ---- dropout on P (the row sum above stays undropped) -----------------------
    if (has_dropout) {
      // One Philox block a (32-row group, pair of n8 tiles, column parity e): the thread's rows of up to two m16
      // tiles (warps own 32-row slabs when kMTiles >= 2) x its column 2t + e of the two tiles (tile::dropout_bits).
      constexpr int kMStep = kMTiles >= 2 ? 2 : 1;
#pragma unroll
      for (int mp = 0; mp < kMTiles; mp += kMStep)
#pragma unroll
        for (int np = 0; np < kNTiles; np += 2)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = n0 + np * 8 + 2 * t + e;
            const tile::Philox4 r = tile::dropout_block(seed, row_of(mp, 0), col, uint32_t(batch * p.h + head),
                                                        rng_offset);
#pragma unroll
            for (int mi = mp; mi < mp + kMStep; ++mi)
#pragma unroll
              for (int nt = np; nt < np + 2; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                  // Word: 32-row slabs start at row % 32 == 0 (m0, warp * 32 and mp * 16 are multiples of 32).
                  const int w = kMTiles >= 2 ? 2 * (mi - mp) + half : (row_of(mi, half) >> 3) & 3;
                  const uint32_t bits = tile::dropout_bits_at(r, w, nt - np);  // n0, np * 8: multiples of 16
                  s[mi][nt][half * 2 + e] *= bits >= p.dropout_threshold ? p.rp_dropout : 0.f;
                }
          }
    }

    uint32_t p_frag[kMTiles][kBlockN / 16][4];
    pack_p<Tr>(p_frag, s);
    gemm_pv<TV>(o, p_frag, v_frag);
  }

  // ---- epilogue: normalise, LSE, O through shared memory to 16-byte stores ---------
  tile::cp_async_wait<0>();
  __syncthreads();  // sQ is free (also when no key block was visible)
  float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
  const float* sink = p.sinks ? p.sinks + head : nullptr;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowNorm n = row_norm(row_max[mi][half] * scale_log2, tile::quad_sum(row_sum[mi][half]), sink);
      const float inv = n.inv;
      const int i = row_of(mi, half);
      if (t == 0 && i < seqlen_q && v_col == 0) lse[i] = n.lse;
      const int r = i - m0;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const uint32_t packed =
            tile::pack2<Tr::kIsBf16>(o[mi][dt][half * 2] * inv, o[mi][dt][half * 2 + 1] * inv);
        *reinterpret_cast<uint32_t*>(smem + tile::swizzle<TV::kRowBytes>(r, (dt * 8 + 2 * t) * 2)) = packed;
      }
    }
  __syncthreads();
  T* out = static_cast<T*>(p.o) + batch * p.o_batch_stride + int64_t(q_start + m0) * p.o_row_stride +
           head * p.o_head_stride + v_col;
  const CopyLane<TV> cl;
  constexpr int kPass = CopyLane<TV>::kRowsPerPass;
  T* dst = out + cl.row * p.o_row_stride + cl.col;
#pragma unroll
  for (int cg = 0; cg < TV::kSmemCols / 64; ++cg) {
    if (!cl.has_group(cg)) continue;
#pragma unroll
    for (int rr = 0; rr < kBlockM / kPass; ++rr) {
      if (cl.row + rr * kPass < seqlen_q - m0) {
        *reinterpret_cast<uint4*>(dst + rr * kPass * p.o_row_stride + cg * 64) =
            *reinterpret_cast<const uint4*>(smem + cl.smem + rr * kPass * TV::kRowBytes + cg * 128);
      }
    }
  }
}

}  // namespace fwd
}  // namespace hf_flash
