// FlashAttention-2 backward on mma.sync (sm80+), main kernel for d <= 128.
// One CTA (8 warps) per (block of 128 keys, kv head, batch): K/V resident in
// smem, dK/dV in registers, loop over the query heads of the GQA group and
// their query blocks (Q, dO, LSE, D double-buffered by cp.async). Per query
// block, two phases and two barriers:
//   AB  warp w owns keys 16w..16w+15: S^T = K Q^T, P, dV += P^T dO, then
//       dP^T = V dO^T, dS (and its d rel_bias sums), dK += dS^T Q, with P^T/dS^T packed straight into
//       the A fragments (no smem round trip; dS^T is also stored for phase C).
//       This order lets the exp of P overlap the dV MMAs and dS the dK MMAs.
//   C   dQ = dS K, added into the fp32 accumulator (8-byte vector reductions
//       on sm90)
// d > 128 runs kernel_large_d.cuh (docs/design/backward-sm90.md).
#pragma once
#include <type_traits>

#include "attn/bwd_common.cuh"

namespace hf_flash {
namespace bwd {

// dst[0..1] += (a, b) in global memory; one 8-byte RED on sm90.
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

template <bool kIsBf16, int kHeadDim>
struct BwdTraits {
  using T = typename tile::Elem<kIsBf16>::T;
  // 128 query rows per step at d64 (faster than 64), 64 otherwise (registers).
  static constexpr int kD = kHeadDim, kBlockN = block_n(kHeadDim), kBlockM = kHeadDim == 64 ? 128 : 64;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRelJ = kBlockM / 8;  // a warp's phase-AB tile: 16 keys x kBlockM queries
  static_assert(kBlockN == 16 * kWarps, "warp w owns keys 16w..16w+15 in phase AB");
  static_assert(kBlockM % 16 == 0 && kD % 16 == 0, "tiles");
  static constexpr int kStages = 2;             // Q/dO/LSE/D buffers
  static constexpr int kStrideD = kD + 8;       // K, V, Q, dO rows (elements)
  static constexpr int kStrideM = kBlockM + 8;  // dS^T rows: one key, kBlockM queries
  // Phase C, dQ = dS K (kBlockM x d): kCWarpsM x (8 / kCWarpsM) warps, each kCTiles m16 tiles x kCCols;
  // 32 x 32 warp tiles where the head dim allows (fewest smem bytes: fewer ldmatrix than 16 x 64).
  static constexpr int kCWarpsM = kBlockM == 64 && kD % 64 == 0 ? 2 : 4;
  static constexpr int kCTiles = kBlockM / 16 / kCWarpsM, kCCols = kD / (kWarps / kCWarpsM);
  static_assert(kCTiles >= 1 && kCCols % 16 == 0, "phase C warp tile");
  // Shared memory, in elements of T, then float LSE and D vectors per stage.
  static constexpr int kK = 0, kV = kK + kBlockN * kStrideD, kQ = kV + kBlockN * kStrideD,
                       kDO = kQ + kStages * kBlockM * kStrideD, kDSt = kDO + kStages * kBlockM * kStrideD,
                       kElems = kDSt + kBlockN * kStrideM;
  static constexpr int kSmemBytes = kElems * 2 + 2 * kStages * kBlockM * sizeof(float);
  static_assert(rel_bias_fits_sm90(kSmemBytes, kRelJ), "sm_90 shared memory, d rel_bias included");
};

template <bool kIsBf16, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_kernel(const BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, size_t copy_floats) {
  using Tr = BwdTraits<kIsBf16, kHeadDim>;
  using T = typename Tr::T;
  constexpr int kD = Tr::kD, kBlockN = Tr::kBlockN, kBlockM = Tr::kBlockM, kStages = Tr::kStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  float* s_lse = reinterpret_cast<float*>(smem + Tr::kElems);  // [stage][row] LSE, then LSE * log2(e)
  float* s_dsum = s_lse + kStages * kBlockM;                    // [stage][row] D, then D * softmax_scale
  float* s_rel = s_dsum + kStages * kBlockM;                    // d rel_bias sums, staging rows (if any)
  const uint32_t sK = tile::smem_u32(smem + Tr::kK), sV = tile::smem_u32(smem + Tr::kV),
                 sQ0 = tile::smem_u32(smem + Tr::kQ), sDO0 = tile::smem_u32(smem + Tr::kDO),
                 sDSt = tile::smem_u32(smem + Tr::kDSt);
  constexpr uint32_t kStageBytes = kBlockM * Tr::kStrideD * 2;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // Grid (key lanes, h_k, batch): CTAs start in linear order, so the key blocks of one head run together
  // and share its Q/dO and dQ rows in L2 (the kv head fastest was slower).
  const int bx = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, lanes = gridDim.x;
  const int groups = p.h / p.h_k;
  const Seq seq(p, b);
  const int n_blocks = (seq.sk + kBlockN - 1) / kBlockN;
  const KeyWindow w(p, seq.sq, seq.sk);
  // Deterministic: this lane owns copy bx (see dq_copies).
  float* dq_base = dq_acc + (p.deterministic ? bx * copy_floats : 0);
  const float scale_over_cap = p.softcap > 0 ? p.softmax_scale / p.softcap : 0.f;
  uint64_t seed = 0;
  uint32_t rng_offset = 0;
  if (p.dropout_p > 0) { seed = uint64_t(p.rng_state[0]); rng_offset = uint32_t(p.rng_state[1]); }
  const bool has_rel = p.rel_bias != nullptr;
  RelBiasGrad<Tr::kRelJ>::zero(p, s_rel, tid, kThreads);  // ordered by the barrier below

  for (int n_block = bx; n_block < n_blocks; n_block += lanes) {
    __syncthreads();  // the previous key block is done with K/V and every buffer
    const KeyBlock kb = begin_key_block<Tr>(p, seq, b, hk, n_block, sK, sV);
    const int n0 = kb.n0, m_begin = kb.m_begin, m_count = kb.m_count;
    const int iters = groups * m_count;  // (query head, query block) pairs: heads outer, blocks inner

    // Q, dO, LSE and D of (head, m0) into stage st, one cp.async group.
    auto issue_loads = [&](int st, int head, int m0) {
      const T* q = static_cast<const T*>(p.q) + p.q_batch_stride * b + int64_t(seq.q0 + m0) * p.q_row_stride +
                   head * p.q_head_stride;
      const T* dout = static_cast<const T*>(p.dout) + p.do_batch_stride * b +
                      int64_t(seq.q0 + m0) * p.do_row_stride + head * p.do_head_stride;
      load_tile<Tr, kBlockM>(sQ0 + st * kStageBytes, q, p.q_row_stride, seq.sq - m0);
      load_tile<Tr, kBlockM>(sDO0 + st * kStageBytes, dout, p.do_row_stride, seq.sq - m0);
      if (tid < kBlockM) {  // rows past the end read as 0; phase AB masks them
        const int i = m0 + tid;
        const bool ok = i < seq.sq;
        const int64_t lse_idx = p.cu_seqlens_q ? head * p.lse_head_stride + seq.q0 + i
                                               : b * p.lse_batch_stride + head * p.lse_head_stride + i;
        cp_async4(tile::smem_u32(s_lse + st * kBlockM + tid), ok ? p.lse + lse_idx : p.lse, ok);
        cp_async4(tile::smem_u32(s_dsum + st * kBlockM + tid),
                  ok ? dsum + int64_t(head) * p.total_q + seq.ws0 + i : dsum, ok);
      }
      tile::cp_async_commit();
    };

    float acc[2][kD / 8][4] = {};  // dV, dK of keys 16w..16w+15 (GQA: summed over the group's heads)
    int head = hk * groups, mi = 0;  // of iteration it
    if (iters > 0) issue_loads(0, head, m_begin * kBlockM);

    for (int it = 0; it < iters; ++it) {
      const int st = it % kStages, m0 = (m_begin + mi) * kBlockM;
      const int next_mi = mi + 1 < m_count ? mi + 1 : 0, next_head = next_mi ? head : head + 1;
      if (it + 1 < iters) {
        issue_loads((it + 1) % kStages, next_head, (m_begin + next_mi) * kBlockM);  // that stage was last read
        tile::cp_async_wait<1>();                                                   // before the last barrier
      } else {
        tile::cp_async_wait<0>();
      }
      if (tid < kBlockM) {  // this thread's LSE/D copies have landed; scale them once for the pointwise code
        s_lse[st * kBlockM + tid] *= kLog2e;
        s_dsum[st * kBlockM + tid] *= p.softmax_scale;
      }
      __syncthreads();  // stage st landed; phase C of it - 1 is done with dS^T
      const uint32_t sQ = sQ0 + st * kStageBytes, sDO = sDO0 + st * kStageBytes;
      const float* lse2 = s_lse + st * kBlockM;
      const float* dsum_scaled = s_dsum + st * kBlockM;

      // ---- Phase AB ------------------------------------------------------------
      {
        const bool full = w.covers(m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1);  // no mask needed
        const float slope2 = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + head] * kLog2e : 0.f;
        // Relative bias: this warp's 16 keys x the block's queries, saturated to one column or not.
        RelBiasGrad<Tr::kRelJ> rel(s_rel, p, head, seq, 1.f / p.softmax_scale);
        const int rel_block = rel.rb.block_column(m0, m0 + kBlockM - 1, n0 + 16 * warp, n0 + 16 * warp + 15);
        // x^T = A B^T over d for this warp's 16 keys (A = K or V rows), all kBlockM queries (B = Q or dO).
        auto gemm_keys = [&](uint32_t sA, uint32_t sB, auto& x) {  // x: float[kBlockM / 8][4]
          const int a_row = 16 * warp + lane % 16, a_col = lane / 16 * 8;
          const int b_row = lane % 8 + lane / 16 * 8, b_col = lane / 8 % 2 * 8;
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) {
            uint32_t a[4];
            tile::ldmatrix_x4(a, sA + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
#pragma unroll
            for (int j = 0; j < kBlockM / 16; ++j) {
              uint32_t bf[4];
              tile::ldmatrix_x4(bf, sB + ((b_row + 16 * j) * Tr::kStrideD + kk * 16 + b_col) * 2);
              mma_pair<kIsBf16>(x[2 * j], x[2 * j + 1], a, bf);
            }
          }
        };
        // out += A B over the kBlockM queries: A = P^T or dS^T fragments, B = dO or Q by ldmatrix.trans.
        auto gemm_queries = [&](const auto& af, uint32_t sB, auto& out) {  // out: float[kD / 8][4]
          const int b_row = lane % 8 + lane / 8 % 2 * 8, b_col = lane / 16 * 8;
#pragma unroll
          for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < kD / 16; ++j) {
              uint32_t bf[4];
              tile::ldmatrix_x4_trans(bf, sB + ((kk * 16 + b_row) * Tr::kStrideD + b_col + 16 * j) * 2);
              mma_pair<kIsBf16>(out[2 * j], out[2 * j + 1], af[kk], bf);
            }
          }
        };
        // Masked block without softcap/ALiBi/dropout (causal diagonal, window edge, sequence end): S = -inf
        // where invisible, so the fast path gives P = 0 and dS = 0 there (LSE is +inf on empty rows: no NaN).
        auto mask = [&](auto& x) {
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int key = n0 + 16 * warp + g + 8 * (r / 2), row = m0 + 8 * j + 2 * t + r % 2;
              if (!w.visible(row, key)) x[j][r] = -INFINITY;
            }
          }
        };
        // P from S in place, and the A fragments of P^T (dropped). kGeneric = false: 2 instructions per
        // element; kGeneric: softcap, ALiBi, masks and dropout, leaving x = P * (1 - tanh^2) under softcap,
        // negated where dropout dropped the element (all dS needs besides dP and D).
        auto probs = [&](auto generic_tag, auto& x, auto& af) {  // af: uint32_t[kBlockM / 16][4]
          constexpr bool kGeneric = decltype(generic_tag)::value;
          tile::Philox4 drop[2] = {};  // this 32-row group's dropout blocks (column parity e)
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
            float pv[4];
            // Dropout: the thread's keys g + {0, 8} x rows 8 j + 2t + e of four consecutive j (a 32-row group,
            // m0 a multiple of 32) are one Philox block per e (tile::dropout_bits), drawn at the group's first j.
            if (kGeneric && p.dropout_p > 0 && j % 4 == 0) {
#pragma unroll
              for (int e = 0; e < 2; ++e)
                drop[e] = tile::dropout_block(seed, m0 + 8 * j + 2 * t + e, n0 + 16 * warp + g, uint32_t(b * p.h + head),
                                              rng_offset);
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const float lse_r = r % 2 ? l2.y : l2.x;
              if constexpr (!kGeneric) {
                pv[r] = x[j][r] = tile::fast_exp2(fmaf(x[j][r], p.softmax_scale_log2, -lse_r));
              } else {
                const int key = n0 + 16 * warp + g + 8 * (r / 2), row = m0 + 8 * j + 2 * t + r % 2;
                float xs = x[j][r], th = 0.f;
                if (p.softcap > 0) { th = tile::fast_tanh(xs * scale_over_cap); xs = p.softcap * th; }
                float s2 = xs * p.softmax_scale_log2;
                if (p.alibi_slopes) s2 -= slope2 * fabsf(float(row + w.diag - key));
                if (has_rel) s2 += kLog2e * __ldg(rel.rb.table + (rel_block >= 0 ? rel_block : rel.rb.column(key - row)));
                const float prob = full || w.visible(row, key) ? tile::fast_exp2(s2 - lse_r) : 0.f;
                bool kept = true;
                if (p.dropout_p > 0) kept = tile::dropout_bits_at(drop[r % 2], j % 4, r / 2) >= p.dropout_threshold;
                pv[r] = kept ? prob * (p.dropout_p > 0 ? p.rp_dropout : 1.f) : 0.f;
                const float pd = p.softcap > 0 ? prob * (1.f - th * th) : prob;
                x[j][r] = kept ? pd : -pd;
              }
            }
            af[j / 2][(j % 2) * 2] = tile::pack2<kIsBf16>(pv[0], pv[1]);
            af[j / 2][(j % 2) * 2 + 1] = tile::pack2<kIsBf16>(pv[2], pv[3]);
          }
        };
        // dS = P * (dP - D) * scale into the A fragments of dS^T and the dS^T smem tile (phase C), and into the
        // d rel_bias sums.
        auto grads = [&](auto dropout_tag, const auto& pf, const auto& dp, auto& af) {
          constexpr bool kDropout = decltype(dropout_tag)::value;
          float block_sum = 0.f;
          if (has_rel) rel.begin(p, s_rel, warp, n0 + 16 * warp, m0, g, t);  // not live across probs()
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            const float2 dsc = *reinterpret_cast<const float2*>(dsum_scaled + 8 * j + 2 * t);
            float ds[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const float d_r = r % 2 ? dsc.y : dsc.x;
              if constexpr (!kDropout) {
                ds[r] = pf[j][r] * fmaf(dp[j][r], p.softmax_scale, -d_r);
              } else {  // dP of a dropped element is 0
                const float dpv = signbit(pf[j][r]) ? 0.f : dp[j][r] * p.rp_dropout;
                ds[r] = fabsf(pf[j][r]) * fmaf(dpv, p.softmax_scale, -d_r);
              }
            }
            if (has_rel) {
              if (rel_block < 0) {
                rel.step(j, ds);
              } else {
                block_sum += (ds[0] + ds[1]) + (ds[2] + ds[3]);
              }
            }
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
              const uint32_t packed = tile::pack2<kIsBf16>(ds[2 * h2], ds[2 * h2 + 1]);
              af[j / 2][(j % 2) * 2 + h2] = packed;
              const int kr = 16 * warp + g + 8 * h2, qc = 8 * j + 2 * t;
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDSt + (kr * Tr::kStrideM + qc) * 2), "r"(packed));
            }
          }
          if (has_rel) {
            if (rel_block < 0) {
              rel.finish();
            } else {
              rel.add_block(rel_block, block_sum);
            }
          }
        };
        const bool plain = p.softcap <= 0.f && !p.alibi_slopes && !has_rel && p.dropout_p <= 0.f;
        // S, P, dV, then dP, dS, dK: on the fast path each elementwise pass shares a basic block with the
        // next GEMM, so the scheduler overlaps them.
        float x[kBlockM / 8][4] = {}, dp[kBlockM / 8][4] = {};
        uint32_t af[kBlockM / 16][4];
        gemm_keys(sK, sQ, x);
        if (plain) {
          if (!full) mask(x);
          probs(std::false_type{}, x, af);
          gemm_queries(af, sDO, acc[0]);
          gemm_keys(sV, sDO, dp);
          grads(std::false_type{}, x, dp, af);
        } else {
          probs(std::true_type{}, x, af);
          gemm_queries(af, sDO, acc[0]);
          gemm_keys(sV, sDO, dp);
          if (p.dropout_p > 0) {
            grads(std::true_type{}, x, dp, af);
          } else {
            grads(std::false_type{}, x, dp, af);
          }
        }
        gemm_queries(af, sQ, acc[1]);
        if (has_rel && rel_block < 0) rel.commit();  // after dK: the tile's registers are free
      }
      __syncthreads();  // dS^T complete; Q/dO of stage st free
      if (has_rel && (next_head != head || it + 1 == iters)) {  // this head's d rel_bias sums are complete
        RelBiasGrad<Tr::kRelJ>(s_rel, p, head, seq, 1.f / p.softmax_scale).flush(p, head);
      }

      // ---- Phase C: dQ = dS K, added into the fp32 accumulator -----------------
      {
        const int wm = warp % Tr::kCWarpsM, wd = warp / Tr::kCWarpsM;
        const int a_row = lane % 8 + lane / 16 * 8, a_col = lane / 8 % 2 * 8;
        const int b_row = lane % 8 + lane / 8 % 2 * 8, b_col = wd * Tr::kCCols + lane / 16 * 8;
        float dq[Tr::kCTiles][Tr::kCCols / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          uint32_t a[Tr::kCTiles][4];
#pragma unroll
          for (int mt = 0; mt < Tr::kCTiles; ++mt)
            tile::ldmatrix_x4_trans(
                a[mt], sDSt + ((kk * 16 + a_row) * Tr::kStrideM + 16 * (wm * Tr::kCTiles + mt) + a_col) * 2);
#pragma unroll
          for (int j = 0; j < Tr::kCCols / 16; ++j) {
            uint32_t bk[4];
            tile::ldmatrix_x4_trans(bk, sK + ((kk * 16 + b_row) * Tr::kStrideD + b_col + 16 * j) * 2);
#pragma unroll
            for (int mt = 0; mt < Tr::kCTiles; ++mt) mma_pair<kIsBf16>(dq[mt][2 * j], dq[mt][2 * j + 1], a[mt], bk);
          }
        }
#pragma unroll
        for (int mt = 0; mt < Tr::kCTiles; ++mt) {
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int i = m0 + 16 * (wm * Tr::kCTiles + mt) + g + 8 * h2;
            if (i < seq.sq) {
              float* dstp = dq_base + (int64_t(seq.ws0 + i) * p.h + head) * kD + wd * Tr::kCCols + 2 * t;
#pragma unroll
              for (int j = 0; j < Tr::kCCols / 8; ++j) red_add2(dstp + 8 * j, dq[mt][j][2 * h2], dq[mt][j][2 * h2 + 1]);
            }
          }
        }
      }
      head = next_head;
      mi = next_mi;
    }
    tile::cp_async_wait<0>();  // no copy may land after the block is done (K/V when iters == 0)

    // ---- dK, dV of this key block ----------------------------------------------
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int key = n0 + 16 * warp + g + 8 * h2;
      store_grad_row<kIsBf16, kD>(p, seq, b, hk, key, 2 * t, h2, true, acc[0]);
      store_grad_row<kIsBf16, kD>(p, seq, b, hk, key, 2 * t, h2, false, acc[1]);
    }
  }
}

}  // namespace bwd
}  // namespace hf_flash
