// FlashAttention backward main kernel on Hopper wgmma (sm_90a), d64 and d128, no softcap / ALiBi / window /
// dropout / deterministic mode (csrc/bwd handles those and every other GPU). Same preprocess, fp32 dQ
// accumulator, convert kernel and grid as csrc/bwd (launch.cuh picks the kernel).
//
// One CTA (2 warpgroups) per (block of 128 keys, kv head, batch): K, V resident in smem, loop over the query
// heads of the GQA group and their query blocks (Q, dO, LSE, D double-buffered by cp.async). Warpgroup w owns
// keys 64w..64w+63; per query block:
//   S^T = K Q^T, dP^T = V dO^T             wgmma, both operands from smem
//   P^T = exp2(S^T scale log2e - LSE log2e), dS^T = P^T (dP^T - D) scale     in registers
//   dV += P^T dO, dK += dS^T Q             wgmma, P^T / dS^T as register A operands, dO / Q MN-major
//   dQ = dS K                              after a barrier: dS^T from smem (MN-major A), K MN-major B;
//                                          warpgroup w adds one 64 x 64 quarter (d64: rows; d128: columns)
//                                          into the fp32 accumulator with 8-byte reductions.
// Issue order dV, (barrier) dQ, dK, so the dQ reductions run under the dK wgmma (+3-6% over dK before dQ).
// Tiles are stored in 128-byte swizzled panels (sm90/wgmma.cuh). See benchmarks/NOTES-sm90.md.
#pragma once

#include "bwd/kernel.cuh"
#include "sm90/wgmma.cuh"

namespace hf_flash {
namespace bwd_sm90 {

template <bool kIsBf16, int kHeadDim>
struct Traits {
  using T = typename tile::Elem<kIsBf16>::T;
  // 128 x 128 (d64) and 128 keys x 64 queries (d128) tiles: dK, dV and S^T, dP^T fit in 255 registers.
  static constexpr int kD = kHeadDim, kBlockN = 128, kBlockM = kHeadDim == 64 ? 128 : 64;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "instantiated head dims");
  static_assert(kBlockN == bwd::block_n(kHeadDim), "the grid (bwd::num_n_blocks) is shared with csrc/bwd");
  static_assert(bwd::kThreads == 256 && kBlockN == 2 * 64, "two warpgroups of 64 keys");
  // dQ (kBlockM x kD) in two 64 x 64 quarters: by rows when kBlockM = 128, else by columns.
  static constexpr bool kDqSplitRows = kBlockM == 128;
  static_assert((kDqSplitRows ? kD : kD / 2) == 64 && (kDqSplitRows ? kBlockM / 2 : kBlockM) == 64, "dQ quarters");
  // Shared memory in bytes from a 1024-aligned base: K, V, 2 stages of Q and dO, dS^T, LSE, D.
  static constexpr int kKVBytes = kBlockN * kD * 2, kQBytes = kBlockM * kD * 2;
  static constexpr int kK = 0, kV = kKVBytes, kQ = 2 * kKVBytes, kDO = kQ + 2 * kQBytes, kDSt = kDO + 2 * kQBytes,
                       kLse = kDSt + kBlockN * kBlockM * 2, kDsum = kLse + 2 * kBlockM * 4,
                       kSmemBytes = kDsum + 2 * kBlockM * 4 + 1024;  // + alignment slack
};

// Rows [0, kRows) x kD of a row-major tile into panels (rows >= limit zero-filled).
template <class T, int kRows, int kD>
__device__ __forceinline__ void load_panels(uint32_t smem, const T* gmem, int64_t row_stride, int limit) {
  constexpr int kChunks = kD / 8, kRowStep = bwd::kThreads / kChunks;
  static_assert(kRows % kRowStep == 0, "whole passes");
  const int r0 = threadIdx.x / kChunks, col = threadIdx.x % kChunks * 8;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = r < limit;
    tile::cp_async16(smem + sm90::panel_offset(kRows, r, col), ok ? gmem + r * row_stride + col : gmem, ok);
  }
}

template <bool kIsBf16, int kHeadDim>
__global__ void __launch_bounds__(bwd::kThreads, 1)
    main_kernel(const BwdParams p, const float* __restrict__ dsum, float* __restrict__ dq_acc, size_t) {
#ifdef HF_SM90_ENABLED
  using Tr = Traits<kIsBf16, kHeadDim>;
  using T = typename Tr::T;
  constexpr int kD = Tr::kD, kBlockN = Tr::kBlockN, kBlockM = Tr::kBlockM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = tile::smem_u32(smem_raw), base = (raw + 1023) & ~1023u;
  float* s_lse = reinterpret_cast<float*>(smem_raw + (base - raw) + Tr::kLse);    // [stage][row] LSE * log2(e)
  float* s_dsum = reinterpret_cast<float*>(smem_raw + (base - raw) + Tr::kDsum);  // [stage][row] D * scale
  const uint32_t sK = base + Tr::kK, sV = base + Tr::kV, sDSt = base + Tr::kDSt;
  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32 % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int hk = blockIdx.y, b = blockIdx.z, groups = p.h / p.h_k;
  const bwd::Seq seq(p, b);
  const int n0 = blockIdx.x * kBlockN;
  if (n0 >= seq.sk) return;  // varlen: past this sequence's keys (the whole CTA)
  const int off = seq.sk - seq.sq;
  const bool causal = p.window_right == 0;  // else unmasked (supported() rules out windows)

  load_panels<T, kBlockN, kD>(sK, static_cast<const T*>(p.k) + p.k_batch_stride * b +
                                      int64_t(seq.k0 + n0) * p.k_row_stride + hk * p.k_head_stride,
                              p.k_row_stride, seq.sk - n0);
  load_panels<T, kBlockN, kD>(sV, static_cast<const T*>(p.v) + p.v_batch_stride * b +
                                      int64_t(seq.k0 + n0) * p.v_row_stride + hk * p.v_head_stride,
                              p.v_row_stride, seq.sk - n0);
  tile::cp_async_commit();
  const bwd::KeyBlock kb = bwd::query_blocks<kBlockN, kBlockM>(p, seq, n0);
  const int iters = groups * kb.m_count;  // (query head, query block) pairs: heads outer, blocks inner

  // Q, dO, LSE and D of (head, m0) into stage st, one cp.async group.
  auto issue_loads = [&](int st, int head, int m0) {
    load_panels<T, kBlockM, kD>(base + Tr::kQ + st * Tr::kQBytes,
                                static_cast<const T*>(p.q) + p.q_batch_stride * b +
                                    int64_t(seq.q0 + m0) * p.q_row_stride + head * p.q_head_stride,
                                p.q_row_stride, seq.sq - m0);
    load_panels<T, kBlockM, kD>(base + Tr::kDO + st * Tr::kQBytes,
                                static_cast<const T*>(p.dout) + p.do_batch_stride * b +
                                    int64_t(seq.q0 + m0) * p.do_row_stride + head * p.do_head_stride,
                                p.do_row_stride, seq.sq - m0);
    if (tid < kBlockM) {  // rows past the end read as 0; they are masked
      const int i = m0 + tid;
      const bool ok = i < seq.sq;
      const int64_t lse_idx = p.cu_seqlens_q ? head * p.lse_head_stride + seq.q0 + i
                                             : b * p.lse_batch_stride + head * p.lse_head_stride + i;
      bwd::cp_async4(tile::smem_u32(s_lse + st * kBlockM + tid), ok ? p.lse + lse_idx : p.lse, ok);
      bwd::cp_async4(tile::smem_u32(s_dsum + st * kBlockM + tid),
                     ok ? dsum + int64_t(head) * p.total_q + seq.ws0 + i : dsum, ok);
    }
    tile::cp_async_commit();
  };

  float dv[kD / 8][4] = {}, dk[kD / 8][4] = {};  // this warpgroup's 64 keys (GQA: summed over the group)
  float s[kBlockM / 8][4] = {}, dp[kBlockM / 8][4] = {}, dq[8][4] = {};
  const int key0 = n0 + 64 * wg + 16 * warp + g;  // this thread's keys: key0, key0 + 8
  int head = hk * groups, mi = 0;                  // of iteration it
  if (iters > 0) issue_loads(0, head, kb.m_begin * kBlockM);

  for (int it = 0; it < iters; ++it) {
    const int st = it % 2, m0 = (kb.m_begin + mi) * kBlockM;
    const int next_mi = mi + 1 < kb.m_count ? mi + 1 : 0, next_head = next_mi ? head : head + 1;
    tile::cp_async_wait<0>();
    if (tid < kBlockM) {  // this thread's LSE/D copies have landed; scale them once for the pointwise code
      s_lse[st * kBlockM + tid] *= bwd::kLog2e;
      s_dsum[st * kBlockM + tid] *= p.softmax_scale;
    }
    sm90::fence_proxy_async();  // this thread's cp.async data, visible to wgmma after the barrier
    __syncthreads();            // stage st landed; iteration it - 1 is done with stage st ^ 1 and dS^T
    if (it + 1 < iters) issue_loads(st ^ 1, next_head, (kb.m_begin + next_mi) * kBlockM);
    const uint32_t sQ = base + Tr::kQ + st * Tr::kQBytes, sDO = base + Tr::kDO + st * Tr::kQBytes;
    const float* lse2 = s_lse + st * kBlockM;
    const float* dsum_scaled = s_dsum + st * kBlockM;

    // S^T = K Q^T and dP^T = V dO^T over d (this warpgroup's 64 key rows of K / V, all query rows of Q / dO),
    // K-major operands: k16 steps walk the 128-byte panel rows in 32 bytes; one commit group each.
    auto gemm_keys = [&](uint32_t sKeys, uint32_t sQueries, auto& acc) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t a = (kk / 4) * kBlockN * 128 + wg * 64 * 128 + kk % 4 * 32;
        const uint32_t bq = (kk / 4) * kBlockM * 128 + kk % 4 * 32;
        sm90::mma_ss<kBlockM, kIsBf16, 0, 0>(acc, sm90::desc(sKeys + a, 16), sm90::desc(sQueries + bq, 16), kk > 0);
      }
      sm90::commit();
    };
    sm90::fence();
    gemm_keys(sK, sQ, s);
    gemm_keys(sV, sDO, dp);

    // P^T (masked: causal diagonal, sequence ends) into the A fragments of dV += P^T dO.
    sm90::wait<1>();
    sm90::fence_operand(s);
    const bool full = n0 + kBlockN <= seq.sk && m0 + kBlockM <= seq.sq && (!causal || n0 + kBlockN - 1 <= m0 + off);
    uint32_t pa[kBlockM / 16][4], dsa[kBlockM / 16][4];
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + 8 * j + 2 * t);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int key = key0 + 8 * (r / 2), row = m0 + 8 * j + 2 * t + r % 2;
        const float prob = tile::fast_exp2(fmaf(s[j][r], p.softmax_scale_log2, -(r % 2 ? l2.y : l2.x)));
        s[j][r] = full || (row < seq.sq && key < seq.sk && (!causal || key <= row + off)) ? prob : 0.f;
      }
      pa[j / 2][(j % 2) * 2] = tile::pack2<kIsBf16>(s[j][0], s[j][1]);
      pa[j / 2][(j % 2) * 2 + 1] = tile::pack2<kIsBf16>(s[j][2], s[j][3]);
    }
    // dS^T = P^T (dP^T - D) scale into the A fragments of dK += dS^T Q and the dS^T tile for dQ.
    sm90::wait<0>();
    sm90::fence_operand(dp);
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      const float2 dsc = *reinterpret_cast<const float2*>(dsum_scaled + 8 * j + 2 * t);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const uint32_t packed = tile::pack2<kIsBf16>(s[j][2 * h2] * fmaf(dp[j][2 * h2], p.softmax_scale, -dsc.x),
                                                     s[j][2 * h2 + 1] * fmaf(dp[j][2 * h2 + 1], p.softmax_scale, -dsc.y));
        dsa[j / 2][(j % 2) * 2 + h2] = packed;
        const int kr = 64 * wg + 16 * warp + g + 8 * h2;  // key row of the CTA's dS^T tile
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDSt + sm90::panel_offset(kBlockN, kr, 8 * j + 2 * t)),
                     "r"(packed));
      }
    }
    // dV += P^T dO (and dK += dS^T Q below): k16 steps are 16 query rows (2048 bytes) of the MN-major panels.
    sm90::fence();
    sm90::fence_operand(dv);
    sm90::fence_operand(dk);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      sm90::mma_rs<kD, kIsBf16, 1>(dv, pa[kk], sm90::desc(sDO + kk * 2048, kBlockM * 128), true);
    sm90::commit();
    sm90::fence_proxy_async();  // this thread's dS^T stores, visible to wgmma after the barrier
    __syncthreads();            // dS^T complete

    // dQ quarter = dS K over the 128 keys: dS^T panels (MN-major A), K panels (MN-major B).
    const int wm = Tr::kDqSplitRows ? wg : 0, wd = Tr::kDqSplitRows ? 0 : wg;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      sm90::mma_ss<64, kIsBf16, 1, 1>(dq, sm90::desc(sDSt + wm * kBlockN * 128 + kk * 2048, kBlockN * 128),
                                      sm90::desc(sK + wd * kBlockN * 128 + kk * 2048, kBlockN * 128), kk > 0);
    sm90::commit();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      sm90::mma_rs<kD, kIsBf16, 1>(dk, dsa[kk], sm90::desc(sQ + kk * 2048, kBlockM * 128), true);
    sm90::commit();
    sm90::wait<1>();  // dQ done; dK runs under the reductions
    sm90::fence_operand(dq);
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = m0 + 64 * wm + 16 * warp + g + 8 * h2;
      if (i < seq.sq) {
        float* dst = dq_acc + (int64_t(seq.ws0 + i) * p.h + head) * kD + 64 * wd + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) bwd::red_add2(dst + 8 * j, dq[j][2 * h2], dq[j][2 * h2 + 1]);
      }
    }
    sm90::wait<0>();
    sm90::fence_operand(dv);
    sm90::fence_operand(dk);
    head = next_head;
    mi = next_mi;
  }
  tile::cp_async_wait<0>();  // no copy may land after the CTA is done (K/V when iters == 0)

#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    bwd::store_grad_row<kIsBf16, kD>(p, seq, b, hk, key0 + 8 * h2, 2 * t, h2, true, dv);
    bwd::store_grad_row<kIsBf16, kD>(p, seq, b, hk, key0 + 8 * h2, 2 * t, h2, false, dk);
  }
#endif  // HF_SM90_ENABLED
}

// Whether this kernel runs the backward of p: a CC 9.0 GPU, a build with sm_90a code for it, and none of the
// features it leaves to csrc/bwd (use_sm90: HF_FLASH_DISABLE_SM90=1 forces csrc/bwd).
template <bool kIsBf16, int kHeadDim>
bool supported(const BwdParams& p) {
  if constexpr (kHeadDim != 64 && kHeadDim != 128) {
    return false;
  } else {
    static const bool has_sm90_code = sm90::has_sm90a_code(main_kernel<kIsBf16, kHeadDim>);
    return use_sm90(p) && has_sm90_code && p.softcap <= 0.f && !p.alibi_slopes &&
           p.p_dropout <= 0.f && !p.deterministic && p.window_left < 0 && p.window_right <= 0;
  }
}

}  // namespace bwd_sm90
}  // namespace hf_flash
