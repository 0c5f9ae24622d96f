// FlashAttention-2 backward on mma.sync (sm80+), v2 main kernel for d <= 128.
// One CTA (8 warps) per (block of 128 keys, kv head, batch): K/V resident in
// smem, dK/dV in registers, loop over the query heads of the GQA group and
// their query blocks (Q, dO, LSE, D double-buffered by cp.async). Per query
// block, two phases and two barriers:
//   AB  warp w owns keys 16w..16w+15: S^T = K Q^T and dP^T = V dO^T, P and dS
//       recomputed in registers, packed to 16-bit A fragments that feed
//       dV += P^T dO and dK += dS^T Q directly (no smem round trip); dS^T is
//       also stored to smem for phase C
//   C   dQ = dS K, added into the fp32 accumulator (8-byte vector reductions
//       on sm90)
// The v1 kernel (kernel_v1.cuh) stays for d > 128. See benchmarks/NOTES-bwd.md.
#pragma once
#include <type_traits>

#include "bwd/common.cuh"

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

// 4-byte cp.async, zero-filled when !pred.
__device__ __forceinline__ void cp_async4(uint32_t smem_addr, const void* gmem, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(pred ? 4 : 0));
}

// Kernel options (bench A/B, HF_FLASH_BWD_VARIANT=5): the pre-v2.1 masked-block path (generic code).
constexpr int kOptLegacy = 1;

template <bool kIsBf16, int kHeadDim, int kBlockM_, bool kKVRegs_>
struct Traits {
  using T = typename tile::Elem<kIsBf16>::T;
  static constexpr int kD = kHeadDim, kBlockN = block_n(kHeadDim), kBlockM = kBlockM_, kWarps = kThreads / 32;
  static constexpr bool kKVRegs = kKVRegs_;  // K/V A fragments of the warp's 16 keys kept in registers
  static_assert(kBlockN == 16 * kWarps, "warp w owns keys 16w..16w+15 in phase AB");
  static_assert(kBlockM % 16 == 0 && kD % 16 == 0, "tiles");
  static constexpr int kStages = 2;             // Q/dO/LSE/D buffers
  static constexpr int kStrideD = kD + 8;       // K, V, Q, dO rows (elements)
  static constexpr int kStrideM = kBlockM + 8;  // dS^T rows: one key, kBlockM queries
  // Phase C, dQ = dS K (kBlockM x d): 4 x 2 warps, each kCTiles m16 tiles x kCCols.
  static constexpr int kCWarpsM = 4, kCTiles = kBlockM / 16 / kCWarpsM, kCCols = kD / (kWarps / kCWarpsM);
  static_assert(kCTiles >= 1 && kCCols % 16 == 0, "phase C warp tile");
  // Shared memory, in elements of T, then float LSE and D vectors per stage.
  static constexpr int kK = 0, kV = kK + kBlockN * kStrideD, kQ = kV + kBlockN * kStrideD,
                       kDO = kQ + kStages * kBlockM * kStrideD, kDSt = kDO + kStages * kBlockM * kStrideD,
                       kElems = kDSt + kBlockN * kStrideM;
  static constexpr int kSmemBytes = kElems * 2 + 2 * kStages * kBlockM * sizeof(float);
};

template <bool kIsBf16, int kHeadDim, int kBlockM_, bool kKVRegs_>
__global__ void __launch_bounds__(kThreads, 1)
    main_kernel(const BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, size_t copy_floats,
                int opts) {
  using Tr = Traits<kIsBf16, kHeadDim, kBlockM_, kKVRegs_>;
  using T = typename Tr::T;
  constexpr int kD = Tr::kD, kBlockN = Tr::kBlockN, kBlockM = Tr::kBlockM, kStages = Tr::kStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  float* s_lse = reinterpret_cast<float*>(smem + Tr::kElems);  // [stage][row] natural-log LSE
  float* s_dsum = s_lse + kStages * kBlockM;                    // [stage][row] D
  const uint32_t sK = tile::smem_u32(smem + Tr::kK), sV = tile::smem_u32(smem + Tr::kV),
                 sQ0 = tile::smem_u32(smem + Tr::kQ), sDO0 = tile::smem_u32(smem + Tr::kDO),
                 sDSt = tile::smem_u32(smem + Tr::kDSt);
  constexpr uint32_t kStageBytes = kBlockM * Tr::kStrideD * 2;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // Grid (key lanes, h_k, batch): CTAs start in linear order, so the key blocks of one head run together
  // and share its Q/dO and dQ rows in L2 (kv head fastest measured 8-15% slower, NOTES-bwd.md v2.1).
  const int bx = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, lanes = gridDim.x;
  const int groups = p.h / p.h_k;
  const Seq seq(p, b);
  const int n_blocks = (seq.sk + kBlockN - 1) / kBlockN;
  const int off = seq.sk - seq.sq;  // diagonal offset (bottom-right alignment)
  const int wl = p.window_left, wr = p.window_right;
  // Deterministic: this lane owns copy bx (see dq_copies).
  float* dq_base = dq_acc + (p.deterministic ? bx * copy_floats : 0);
  const float scale_over_cap = p.softcap > 0 ? p.softmax_scale / p.softcap : 0.f;
  uint64_t seed = 0;
  uint32_t rng_offset = 0;
  if (p.p_dropout > 0) { seed = uint64_t(p.rng_state[0]); rng_offset = uint32_t(p.rng_state[1]); }

  for (int n_block = bx; n_block < n_blocks; n_block += lanes) {
    const int n0 = n_block * kBlockN;
    __syncthreads();  // the previous key block is done with K/V and every buffer
    const T* k = static_cast<const T*>(p.k) + p.k_batch_stride * b + int64_t(seq.k0 + n0) * p.k_row_stride +
                 hk * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + p.v_batch_stride * b + int64_t(seq.k0 + n0) * p.v_row_stride +
                 hk * p.v_head_stride;
    load_tile<Tr>(sK, k, p.k_row_stride, kBlockN, seq.sk - n0);
    load_tile<Tr>(sV, v, p.v_row_stride, kBlockN, seq.sk - n0);
    tile::cp_async_commit();

    // Query rows that see at least one key of this block.
    int m_lo = 0, m_hi = seq.sq;
    if (wr >= 0) m_lo = max(0, n0 - off - wr);
    if (wl >= 0) m_hi = min(seq.sq, n0 + kBlockN - off + wl);
    const int m_begin = m_lo / kBlockM, m_count = m_hi > m_lo ? (m_hi + kBlockM - 1) / kBlockM - m_begin : 0;
    const int iters = groups * m_count;  // (query head, query block) pairs

    // Q, dO, LSE and D of iteration `it` into stage it % kStages, one cp.async group.
    auto issue_loads = [&](int it) {
      const int st = it % kStages, head = hk * groups + it / m_count, m0 = (m_begin + it % m_count) * kBlockM;
      const T* q = static_cast<const T*>(p.q) + p.q_batch_stride * b + int64_t(seq.q0 + m0) * p.q_row_stride +
                   head * p.q_head_stride;
      const T* dout = static_cast<const T*>(p.dout) + p.do_batch_stride * b +
                      int64_t(seq.q0 + m0) * p.do_row_stride + head * p.do_head_stride;
      load_tile<Tr>(sQ0 + st * kStageBytes, q, p.q_row_stride, kBlockM, seq.sq - m0);
      load_tile<Tr>(sDO0 + st * kStageBytes, dout, p.do_row_stride, kBlockM, seq.sq - m0);
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

    float dv[kD / 8][4] = {}, dk[kD / 8][4] = {};
    uint32_t kf[Tr::kKVRegs ? kD / 16 : 1][4], vf[Tr::kKVRegs ? kD / 16 : 1][4];
    if (iters > 0) issue_loads(0);

    for (int it = 0; it < iters; ++it) {
      const int st = it % kStages, head = hk * groups + it / m_count, m0 = (m_begin + it % m_count) * kBlockM;
      if (it + 1 < iters) {
        issue_loads(it + 1);  // its stage was last read in phase AB of it - 1 (before that barrier)
        tile::cp_async_wait<1>();
      } else {
        tile::cp_async_wait<0>();
      }
      __syncthreads();  // stage st landed; phase C of it - 1 is done with dS^T
      const uint32_t sQ = sQ0 + st * kStageBytes, sDO = sDO0 + st * kStageBytes;
      const float* lse = s_lse + st * kBlockM;
      const float* dsm = s_dsum + st * kBlockM;
      const int a_row = 16 * warp + lane % 16, a_col = lane / 16 * 8;
      if constexpr (Tr::kKVRegs) {
        if (it == 0) {
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) {
            tile::ldmatrix_x4(kf[kk], sK + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
            tile::ldmatrix_x4(vf[kk], sV + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
          }
        }
      }

      // ---- Phase AB ------------------------------------------------------------
      {
        float s[kBlockM / 8][4] = {}, dp[kBlockM / 8][4] = {};
        {
          const int b_row = lane % 8 + lane / 16 * 8, b_col = lane / 8 % 2 * 8;
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) {
            uint32_t ak[4], av[4];
            if constexpr (Tr::kKVRegs) {
#pragma unroll
              for (int r = 0; r < 4; ++r) { ak[r] = kf[kk][r]; av[r] = vf[kk][r]; }
            } else {
              tile::ldmatrix_x4(ak, sK + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
              tile::ldmatrix_x4(av, sV + (a_row * Tr::kStrideD + kk * 16 + a_col) * 2);
            }
#pragma unroll
            for (int j = 0; j < kBlockM / 16; ++j) {
              const int addr = ((b_row + 16 * j) * Tr::kStrideD + kk * 16 + b_col) * 2;
              uint32_t bq[4], bo[4];
              tile::ldmatrix_x4(bq, sQ + addr);
              tile::ldmatrix_x4(bo, sDO + addr);
              mma_pair<kIsBf16>(s[2 * j], s[2 * j + 1], ak, bq);
              mma_pair<kIsBf16>(dp[2 * j], dp[2 * j + 1], av, bo);
            }
          }
        }
        // A block needs masking where a key or query is past the end or a window edge crosses it.
        const bool full = n0 + kBlockN <= seq.sk && m0 + kBlockM <= seq.sq &&
                          (wr < 0 || n0 + kBlockN - 1 <= m0 + off + wr) &&
                          (wl < 0 || n0 >= m0 + kBlockM - 1 + off - wl);
        const float slope2 = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + head] * kLog2e : 0.f;
        uint32_t pt[kBlockM / 16][4], dst[kBlockM / 16][4];  // A fragments of P^T and dS^T (k = queries)
        // P, dS from S, dP. Mode 0 (no softcap, ALiBi or dropout; masked blocks get S = -inf first, below):
        // 4 instructions per element; mode 2 (softcap, ALiBi or dropout, or opts & kOptLegacy on a masked
        // block): the generic code.
        auto pointwise = [&](auto mode_tag) {
          constexpr int kMode = decltype(mode_tag)::value;
          constexpr bool kGeneric = kMode == 2;
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
            const int qc = 8 * j + 2 * t;
            const float2 lse_j = *reinterpret_cast<const float2*>(lse + qc);
            const float2 dsum_j = *reinterpret_cast<const float2*>(dsm + qc);
            const float lse2[2] = {lse_j.x * kLog2e, lse_j.y * kLog2e};
            const float dsv_row[2] = {kGeneric ? dsum_j.x : dsum_j.x * p.softmax_scale,
                                      kGeneric ? dsum_j.y : dsum_j.y * p.softmax_scale};
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {  // accumulator rows g and g + 8
              const int kr = 16 * warp + g + 8 * h2;
              float pv[2], dsv[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                if constexpr (kMode == 0) {
                  const float prob = tile::fast_exp2(fmaf(s[j][2 * h2 + e], p.softmax_scale_log2, -lse2[e]));
                  pv[e] = prob;
                  dsv[e] = prob * fmaf(dp[j][2 * h2 + e], p.softmax_scale, -dsv_row[e]);
                } else {
                  const int key = n0 + kr, row = m0 + qc + e;
                  float x = s[j][2 * h2 + e], th = 0.f;
                  if (p.softcap > 0) { th = tile::fast_tanh(x * scale_over_cap); x = p.softcap * th; }
                  float s2 = x * p.softmax_scale_log2;
                  if (p.alibi_slopes) s2 -= slope2 * fabsf(float(row + off - key));
                  const bool visible = full || (row < seq.sq && key < seq.sk && (wl < 0 || key >= row + off - wl) &&
                                                (wr < 0 || key <= row + off + wr));
                  const float prob = visible ? tile::fast_exp2(s2 - lse2[e]) : 0.f;
                  float dpv = dp[j][2 * h2 + e], pdrop = prob;
                  if (p.p_dropout > 0) {
                    const tile::Philox4 r = tile::philox(seed, uint32_t(key) >> 2, row, b * p.h + head, rng_offset);
                    const uint32_t word = (key & 3) == 0 ? r.x : (key & 3) == 1 ? r.y : (key & 3) == 2 ? r.z : r.w;
                    const float keep = word >= p.dropout_threshold ? p.rp_dropout : 0.f;
                    pdrop = prob * keep;
                    dpv *= keep;
                  }
                  float ds = prob * (dpv - dsv_row[e]);
                  if (p.softcap > 0) ds *= 1.f - th * th;
                  pv[e] = pdrop;
                  dsv[e] = ds * p.softmax_scale;
                }
              }
              pt[j / 2][(j % 2) * 2 + h2] = tile::pack2<kIsBf16>(pv[0], pv[1]);
              dst[j / 2][(j % 2) * 2 + h2] = tile::pack2<kIsBf16>(dsv[0], dsv[1]);
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDSt + (kr * Tr::kStrideM + qc) * 2),
                           "r"(dst[j / 2][(j % 2) * 2 + h2]));
            }
          }
        };
        const bool plain = p.softcap <= 0.f && !p.alibi_slopes && p.p_dropout <= 0.f;
        if (plain && !full && !(opts & kOptLegacy)) {
          // Mask only (causal diagonal, window edge, sequence end): S = -inf where invisible, so mode 0
          // gives P = 0 and dS = 0 there (LSE is +inf on empty rows, never -inf: no NaN).
#pragma unroll
          for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int key = n0 + 16 * warp + g + 8 * (r / 2), row = m0 + 8 * j + 2 * t + r % 2;
              const bool visible = row < seq.sq && key < seq.sk && (wl < 0 || key >= row + off - wl) &&
                                   (wr < 0 || key <= row + off + wr);
              if (!visible) s[j][r] = -INFINITY;
            }
          }
        }
        if (plain && (full || !(opts & kOptLegacy))) {
          pointwise(std::integral_constant<int, 0>{});
        } else {
          pointwise(std::integral_constant<int, 2>{});
        }
        // dV += P^T dO, dK += dS^T Q: A from registers, B by ldmatrix.trans.
        const int b_row = lane % 8 + lane / 8 % 2 * 8, b_col = lane / 16 * 8;
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
          for (int j = 0; j < kD / 16; ++j) {
            const int addr = ((kk * 16 + b_row) * Tr::kStrideD + b_col + 16 * j) * 2;
            uint32_t bo[4], bq[4];
            tile::ldmatrix_x4_trans(bo, sDO + addr);
            tile::ldmatrix_x4_trans(bq, sQ + addr);
            mma_pair<kIsBf16>(dv[2 * j], dv[2 * j + 1], pt[kk], bo);
            mma_pair<kIsBf16>(dk[2 * j], dk[2 * j + 1], dst[kk], bq);
          }
        }
      }
      __syncthreads();  // dS^T complete; Q/dO of stage st free

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
    }
    tile::cp_async_wait<0>();  // no copy may land after the block is done (K/V when iters == 0)

    // ---- dK, dV of this key block (GQA: summed over the group's query heads) ----
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int key = n0 + 16 * warp + g + 8 * h2;
      if (key < seq.sk) {
        T* dkp = static_cast<T*>(p.dk) + p.dk_batch_stride * b + int64_t(seq.k0 + key) * p.dk_row_stride +
                 hk * p.dk_head_stride + 2 * t;
        T* dvp = static_cast<T*>(p.dv) + p.dv_batch_stride * b + int64_t(seq.k0 + key) * p.dv_row_stride +
                 hk * p.dv_head_stride + 2 * t;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          *reinterpret_cast<uint32_t*>(dkp + 8 * j) = tile::pack2<kIsBf16>(dk[j][2 * h2], dk[j][2 * h2 + 1]);
          *reinterpret_cast<uint32_t*>(dvp + 8 * j) = tile::pack2<kIsBf16>(dv[j][2 * h2], dv[j][2 * h2 + 1]);
        }
      }
    }
  }
}

}  // namespace bwd
}  // namespace hf_flash
