// Backward main kernel on mma.sync for d > 128, where the 64-key block does not
// let the P^T/dS^T accumulators feed the dV/dK GEMMs from registers:
// phases A (S^T, dP^T, P^T/dS^T to smem), B (dV, dK), C (dQ, atomics),
// three barriers per query block.
#pragma once
#include "attn/bwd_common.cuh"

namespace hf_flash {
namespace bwd {

template <bool kIsBf16, int kHeadDim>
struct BwdLargeDTraits {
  using T = typename tile::Elem<kIsBf16>::T;
  static constexpr int kBlockM = 64;
  static constexpr int kD = kHeadDim, kBlockN = block_n(kHeadDim), kWarps = kThreads / 32;
  static constexpr int kStrideD = kD + 8;       // K, V, Q, dO rows (elements)
  static constexpr int kStrideM = kBlockM + 8;  // P^T, dS^T rows: one key, kBlockM queries
  // Phase A, S^T = K Q^T and dP^T = V dO^T (kBlockN x kBlockM): warps tile keys x queries.
  static constexpr int kAWarpsN = kBlockN / 16, kACols = kBlockM / (kWarps / kAWarpsN);
  static constexpr int kRelJ = kACols / 8;  // a warp's phase-A tile: 16 keys x kACols queries
  // Phase B, dV += P^T dO and dK += dS^T Q (kBlockN x d): warps tile keys x head dim.
  static constexpr int kBWarpsN = kBlockN / 16, kBCols = kD / (kWarps / kBWarpsN);
  // Phase C, dQ = dS K (kBlockM x d): warps tile queries x head dim, kCChunk columns at a time (d512: two
  // chunks, so dQ's registers do not add to dK's and dV's all at once).
  static constexpr int kCWarpsM = kBlockM / 16, kCCols = kD / (kWarps / kCWarpsM);
  static constexpr int kCChunk = kCCols > 128 ? 128 : kCCols;
  static_assert(kACols % 16 == 0 && kBCols % 16 == 0 && kCCols % 16 == 0, "warp tiles are pairs of n8 tiles");
  // Shared memory, in elements of T, then two float vectors of kBlockM.
  static constexpr int kK = 0, kV = kK + kBlockN * kStrideD, kQ = kV + kBlockN * kStrideD,
                       kDO = kQ + kBlockM * kStrideD, kPt = kDO + kBlockM * kStrideD,
                       kDSt = kPt + kBlockN * kStrideM, kElems = kDSt + kBlockN * kStrideM;
  static constexpr int kSmemBytes = kElems * 2 + 2 * kBlockM * sizeof(float);
  static_assert(rel_bias_fits_sm90(kSmemBytes, kRelJ), "sm_90 shared memory, d rel_bias included");
};

template <bool kIsBf16, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_large_d_kernel(const BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, size_t copy_floats) {
  using Tr = BwdLargeDTraits<kIsBf16, kHeadDim>;
  using T = typename Tr::T;
  constexpr int kD = Tr::kD, kBlockN = Tr::kBlockN, kBlockM = Tr::kBlockM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  float* s_lse2 = reinterpret_cast<float*>(smem + Tr::kElems);  // LSE * log2(e) of the query block
  float* s_dsum = s_lse2 + kBlockM;
  float* s_rel = s_dsum + kBlockM;  // d rel_bias sums, staging rows (if any)
  const uint32_t sK = tile::smem_u32(smem + Tr::kK), sV = tile::smem_u32(smem + Tr::kV),
                 sQ = tile::smem_u32(smem + Tr::kQ), sDO = tile::smem_u32(smem + Tr::kDO),
                 sPt = tile::smem_u32(smem + Tr::kPt), sDSt = tile::smem_u32(smem + Tr::kDSt);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int hk = blockIdx.y, b = blockIdx.z, groups = p.h / p.h_k;
  const Seq seq(p, b);
  const int n_blocks = (seq.sk + kBlockN - 1) / kBlockN;
  const KeyWindow w(p, seq.sq, seq.sk);
  // Deterministic: this lane owns copy blockIdx.x (see dq_copies).
  float* dq_base = dq_acc + (p.deterministic ? blockIdx.x * copy_floats : 0);
  const float scale_over_cap = p.softcap > 0 ? p.softmax_scale / p.softcap : 0.f;
  uint64_t seed = 0;
  uint32_t rng_offset = 0;
  if (p.dropout_p > 0) { seed = uint64_t(p.rng_state[0]); rng_offset = uint32_t(p.rng_state[1]); }
  const bool has_rel = p.rel_bias != nullptr;
  RelBiasGrad<Tr::kRelJ>::zero(p, s_rel, tid, kThreads);  // ordered by the barrier below

  for (int n_block = blockIdx.x; n_block < n_blocks; n_block += gridDim.x) {
    __syncthreads();  // the previous key block is done with K/V
    const KeyBlock kb = begin_key_block<Tr>(p, seq, b, hk, n_block, sK, sV);
    const int n0 = kb.n0, m_begin = kb.m_begin, m_count = kb.m_count;
    const int iters = groups * m_count;  // (query head, query block) pairs

    // Loads of iteration `it`: Q and dO by cp.async, LSE and D into registers
    // (stored to smem once the previous iteration is done with them).
    float lse2_next = 0.f, dsum_next = 0.f;
    auto issue_loads = [&](int it) {
      const int head = hk * groups + it / m_count, m0 = (m_begin + it % m_count) * kBlockM;
      const T* q = static_cast<const T*>(p.q) + p.q_batch_stride * b + int64_t(seq.q0 + m0) * p.q_row_stride +
                   head * p.q_head_stride;
      const T* dout = static_cast<const T*>(p.dout) + p.do_batch_stride * b +
                      int64_t(seq.q0 + m0) * p.do_row_stride + head * p.do_head_stride;
      load_tile<Tr, kBlockM>(sQ, q, p.q_row_stride, seq.sq - m0);
      load_tile<Tr, kBlockM>(sDO, dout, p.do_row_stride, seq.sq - m0);
      tile::cp_async_commit();
      if (tid < kBlockM) {
        const int i = m0 + tid;
        const bool ok = i < seq.sq;
        const int64_t lse_idx = p.cu_seqlens_q ? head * p.lse_head_stride + seq.q0 + i
                                               : b * p.lse_batch_stride + head * p.lse_head_stride + i;
        lse2_next = ok ? p.lse[lse_idx] * kLog2e : INFINITY;  // +inf: P = 0 for padding and empty rows
        dsum_next = ok ? dsum[int64_t(head) * p.total_q + seq.ws0 + i] : 0.f;
      }
    };
    auto store_row_stats = [&] {
      if (tid < kBlockM) { s_lse2[tid] = lse2_next; s_dsum[tid] = dsum_next; }
    };

    float dv[Tr::kBCols / 8][4] = {}, dk[Tr::kBCols / 8][4] = {};
    if (iters > 0) { issue_loads(0); store_row_stats(); }

    for (int it = 0; it < iters; ++it) {
      const int head = hk * groups + it / m_count, m0 = (m_begin + it % m_count) * kBlockM;
      tile::cp_async_wait<0>();
      __syncthreads();

      // ---- Phase A: S^T = K Q^T, dP^T = V dO^T; P^T and dS^T to smem ----------
      {
        const int wn = warp % Tr::kAWarpsN, wm = warp / Tr::kAWarpsN;
        float s[Tr::kACols / 8][4] = {}, dp[Tr::kACols / 8][4] = {};
        const int a_row = 16 * wn + lane % 16, a_col = lane / 16 * 8;
        const int b_row = wm * Tr::kACols + lane % 8 + lane / 16 * 8, b_col = lane / 8 % 2 * 8;
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t ak[4], av[4];
          tile::ldmatrix_x4(ak, sK + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
          tile::ldmatrix_x4(av, sV + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
#pragma unroll
          for (int j = 0; j < Tr::kACols / 16; ++j) {
            const int addr = ((b_row + 16 * j) * Tr::kStrideD + kk * 16 + b_col) * 2;
            uint32_t bq[4], bo[4];
            tile::ldmatrix_x4(bq, sQ + addr);
            tile::ldmatrix_x4(bo, sDO + addr);
            mma_pair<kIsBf16>(s[2 * j], s[2 * j + 1], ak, bq);
            mma_pair<kIsBf16>(dp[2 * j], dp[2 * j + 1], av, bo);
          }
        }
        // A block needs masking where a key is past the end or a window edge crosses it.
        const bool full = w.covers(m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1);  // no mask needed
        const float slope2 = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + head] * kLog2e : 0.f;
        RelBiasGrad<Tr::kRelJ> rel(s_rel, p, head, seq, 1.f);
        const int rel_block = rel.rb.block_column(m0 + wm * Tr::kACols, m0 + (wm + 1) * Tr::kACols - 1, n0 + 16 * wn,
                                                  n0 + 16 * wn + 15);
        rel.begin(p, s_rel, warp, n0 + 16 * wn, m0 + wm * Tr::kACols, g, t);
        float block_sum = 0.f;
#pragma unroll
        for (int j = 0; j < Tr::kACols / 8; ++j) {
          float ds_j[4];  // d logits of this thread's (j, r) elements, for d rel_bias
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {  // accumulator rows g and g + 8
            const int kr = 16 * wn + g + 8 * h2, qc = wm * Tr::kACols + 8 * j + 2 * t;
            float pv[2], dsv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = n0 + kr, row = m0 + qc + e;
              float x = s[j][2 * h2 + e], th = 0.f;
              if (p.softcap > 0) { th = tile::fast_tanh(x * scale_over_cap); x = p.softcap * th; }
              float s2 = x * p.softmax_scale_log2;
              if (p.alibi_slopes) s2 -= slope2 * fabsf(float(row + w.diag - key));
              if (has_rel) s2 += kLog2e * __ldg(rel.rb.table + (rel_block >= 0 ? rel_block : rel.rb.column(key - row)));
              const float prob = full || w.visible(row, key) ? tile::fast_exp2(s2 - s_lse2[qc + e]) : 0.f;
              float dpv = dp[j][2 * h2 + e], pdrop = prob;
              if (p.dropout_p > 0) {
                const tile::Philox4 r = tile::dropout_block(seed, row, key, uint32_t(b * p.h + head), rng_offset);
                const float keep = tile::dropout_bits(r, row, key) >= p.dropout_threshold ? p.rp_dropout : 0.f;
                pdrop = prob * keep;
                dpv *= keep;
              }
              float ds = prob * (dpv - s_dsum[qc + e]);
              if (p.softcap > 0) ds *= 1.f - th * th;
              ds_j[2 * h2 + e] = ds;
              pv[e] = pdrop;
              dsv[e] = ds * p.softmax_scale;
            }
            const int idx = (kr * Tr::kStrideM + qc) * 2;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sPt + idx), "r"(tile::pack2<kIsBf16>(pv[0], pv[1])));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDSt + idx), "r"(tile::pack2<kIsBf16>(dsv[0], dsv[1])));
          }
          if (has_rel) {
            if (rel_block < 0) {
              rel.step(j, ds_j);
            } else {
              block_sum += (ds_j[0] + ds_j[1]) + (ds_j[2] + ds_j[3]);
            }
          }
        }
        if (has_rel) {
          if (rel_block < 0) {
            rel.finish();
            rel.commit();
          } else {
            rel.add_block(rel_block, block_sum);
          }
        }
      }
      __syncthreads();
      if (has_rel && (it + 1 == iters || (it + 1) / m_count != it / m_count)) {  // this head's sums are complete
        RelBiasGrad<Tr::kRelJ>(s_rel, p, head, seq, 1.f).flush(p, head);
      }

      // ---- Phase B: dV += P^T dO, dK += dS^T Q (registers) ---------------------
      {
        const int wn = warp % Tr::kBWarpsN, wd = warp / Tr::kBWarpsN;
        const int a_row = 16 * wn + lane % 16, a_col = lane / 16 * 8;
        const int b_row = lane % 8 + lane / 8 % 2 * 8, b_col = wd * Tr::kBCols + lane / 16 * 8;
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
          uint32_t ap[4], ads[4];
          tile::ldmatrix_x4(ap, sPt + (a_row * Tr::kStrideM + kk * 16 + a_col) * 2);
          tile::ldmatrix_x4(ads, sDSt + (a_row * Tr::kStrideM + kk * 16 + a_col) * 2);
#pragma unroll
          for (int j = 0; j < Tr::kBCols / 16; ++j) {
            const int addr = ((kk * 16 + b_row) * Tr::kStrideD + b_col + 16 * j) * 2;
            uint32_t bo[4], bq[4];
            tile::ldmatrix_x4_trans(bo, sDO + addr);
            tile::ldmatrix_x4_trans(bq, sQ + addr);
            mma_pair<kIsBf16>(dv[2 * j], dv[2 * j + 1], ap, bo);
            mma_pair<kIsBf16>(dk[2 * j], dk[2 * j + 1], ads, bq);
          }
        }
      }
      __syncthreads();  // Q, dO, LSE, D free: prefetch the next query block under phase C
      if (it + 1 < iters) issue_loads(it + 1);

      // ---- Phase C: dQ = dS K, added into the fp32 accumulator -----------------
      {
        const int wm = warp % Tr::kCWarpsM, wd = warp / Tr::kCWarpsM;
        const int a_row = lane % 8 + lane / 16 * 8, a_col = 16 * wm + lane / 8 % 2 * 8;
        const int b_row = lane % 8 + lane / 8 % 2 * 8;
#pragma unroll
        for (int chunk = 0; chunk < Tr::kCCols; chunk += Tr::kCChunk) {
          const int col0 = wd * Tr::kCCols + chunk, b_col = col0 + lane / 16 * 8;
          float dq[Tr::kCChunk / 8][4] = {};
#pragma unroll
          for (int kk = 0; kk < kBlockN / 16; ++kk) {
            uint32_t a[4];
            tile::ldmatrix_x4_trans(a, sDSt + ((kk * 16 + a_row) * Tr::kStrideM + a_col) * 2);
#pragma unroll
            for (int j = 0; j < Tr::kCChunk / 16; ++j) {
              uint32_t bk[4];
              tile::ldmatrix_x4_trans(bk, sK + ((kk * 16 + b_row) * Tr::kStrideD + b_col + 16 * j) * 2);
              mma_pair<kIsBf16>(dq[2 * j], dq[2 * j + 1], a, bk);
            }
          }
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int i = m0 + 16 * wm + g + 8 * h2;
            if (i < seq.sq) {
              float* dst = dq_base + (int64_t(seq.ws0 + i) * p.h + head) * kD + col0 + 2 * t;
#pragma unroll
              for (int j = 0; j < Tr::kCChunk / 8; ++j) {
                atomicAdd(dst + 8 * j, dq[j][2 * h2]);
                atomicAdd(dst + 8 * j + 1, dq[j][2 * h2 + 1]);
              }
            }
          }
        }
      }
      if (it + 1 < iters) store_row_stats();
    }
    tile::cp_async_wait<0>();  // no copy may land after the block is done (K/V when iters == 0)

    // ---- dK, dV of this key block ----------------------------------------------
    const int wn = warp % Tr::kBWarpsN, wd = warp / Tr::kBWarpsN;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int key = n0 + 16 * wn + g + 8 * h2, col0 = wd * Tr::kBCols + 2 * t;
      store_grad_row<kIsBf16, Tr::kBCols>(p, seq, b, hk, key, col0, h2, false, dk);
      store_grad_row<kIsBf16, Tr::kBCols>(p, seq, b, hk, key, col0, h2, true, dv);
    }
  }
}

}  // namespace bwd
}  // namespace hf_flash
