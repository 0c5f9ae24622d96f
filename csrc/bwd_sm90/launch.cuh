// The Hopper backward (kernel.cuh) around the shared prologue / epilogue: TMA maps, grid, shared memory.
#pragma once
#include "attn/bwd_common.cuh"
#include "bwd_sm90/kernel.cuh"
#include "sm90/schedule.cuh"
#include "sm90/tma.cuh"

namespace hf_flash {

// Before launching anything: cudaErrorNoKernelImageForDevice when this build carries no sm_90a code for the
// kernel, cudaErrorNotSupported when the driver cannot describe the tensors to TMA (e.g. strides that are not
// multiples of 16 bytes); run_bwd then runs the mma.sync backward.
namespace bwd_sm90 {
template <bool kIsBf16, int kHeadDim, Scores kScores>
cudaError_t launch(const BwdParams& p, cudaStream_t stream) {
  using Tr = BwdSm90Traits<kIsBf16, kHeadDim, kScores == Scores::kRelBias>;
  auto kernel = &bwd_sm90_kernel<kIsBf16, kHeadDim, kScores>;
  static const bool has_sm90a = sm90::has_sm90a_code(kernel);
  if (!has_sm90a) return cudaErrorNoKernelImageForDevice;
  bwd::BwdWorkspace ws(p);
  ws.copies = 1;  // one dQ accumulator (deterministic mode orders the additions instead: kernel.cuh)
  // The first add into a dQ block stores it (kernel.cuh): only the counters start at zero.
  if (bwd::sm90_first_add_stores(kHeadDim)) ws.zero_counters_only();
  const bool varlen = p.cu_seqlens_q != nullptr;
  // A varlen tensor is one batch of its total rows.
  const int batches = varlen ? 1 : p.b, rows_q = varlen ? p.total_q : p.seqlen_q;
  const int rows_k = varlen ? p.total_k : p.seqlen_k;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  const sm90::TmaElem elem = sm90::tma_elem(kIsBf16);
  TmaMaps maps;
  cudaError_t err = sm90::make_rows_map(&maps.q, p.q, elem, p.d, p.h, rows_q, batches, p.q_head_stride,
                                        p.q_row_stride, p.q_batch_stride, kBlockM);
  if (err == cudaSuccess) {
    err = sm90::make_rows_map(&maps.dout, p.dout, elem, p.d, p.h, rows_q, batches, p.do_head_stride,
                              p.do_row_stride, p.do_batch_stride, kBlockM);
  }
  if (err == cudaSuccess) {
    err = sm90::make_rows_map(&maps.k, p.k, elem, p.d, p.h_k, rows_k, batches, p.k_head_stride, p.k_row_stride,
                              p.k_batch_stride, kBlockN);
  }
  if (err == cudaSuccess) {
    err = sm90::make_rows_map(&maps.v, p.v, elem, p.d, p.h_k, rows_k, batches, p.v_head_stride, p.v_row_stride,
                              p.v_batch_stride, kBlockN);
  }
  // dq_acc: fp32 (rows, h, d), a dense batch seqlen_q of those rows; d64 / d128 add whole blocks without it.
  if (err == cudaSuccess && !Tr::kDqBlocked) {
    constexpr int kD = Tr::kColumns;
    err = sm90::make_rows_map(&maps.dq_acc, ws.dq_acc, sm90::TmaElem::kF32, kD, p.h, rows_q, batches, kD,
                              int64_t(p.h) * kD, int64_t(p.seqlen_q) * p.h * kD, kBlockM);
  }
  if (err != cudaSuccess) return err;
  BwdParams pk = p;  // + where the d rel_bias sums live
  const int smem = bwd::rel_bias_smem(pk, Tr::kSmemBytes, Tr::kRelJ, Tr::kRelSumsInGmem);
  err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;

  err = bwd::bwd_prologue<kIsBf16, kHeadDim>(p, ws, stream);
  if (err != cudaSuccess) return err;
  // Sections of (kv head, batch) pairs (sm90/schedule.cuh); a pair's key blocks share its Q and dO. Packed rows:
  // sections of kv heads over their packed key blocks (kernel.cuh).
  const bool packed = p.cu_seqlens_k != nullptr;
  const int n_blocks = packed ? int(packed_blocks(p.total_k, p.b, kBlockN)) : bwd::num_n_blocks(p, kBlockN);
  const int pairs = packed ? p.h_k : p.h_k * p.b;
  const int group = sm90::section_group(p.window_right == 0, pairs, n_blocks, p.num_sms,
                                        int64_t(p.h / p.h_k) * p.seqlen_q * p.d * 2 * 2, int64_t(32) << 20,
                                        p.deterministic);
  // A dependent of the prologue's last kernel and the convert kernel's primary: 2-4 launch gaps a call hidden.
  // d512: a cluster of two CTAs a tile (kernel.cuh).
  err = launch_kernel(kernel, Tr::kCtasPerTile * n_blocks * pairs, Tr::kThreads, smem, stream,
                      LaunchAttrs(/*dependent=*/true, Tr::kCtasPerTile), pk, maps, ws.dsum, ws.counters, group,
                      ws.dq_acc);
  if (err != cudaSuccess) return err;
  return bwd::bwd_epilogue<kIsBf16, kHeadDim>(p, ws, stream, /*dependent=*/true, Tr::kDqBlocked ? kBlockM : 0);
}
}  // namespace bwd_sm90

template <bool kIsBf16, int kHeadDim>
cudaError_t run_bwd_sm90_hdim(const BwdParams& p, cudaStream_t stream) {
  return run_for_scores(p, [&](auto scores) {
    constexpr Scores kScores = decltype(scores)::value;
    if constexpr (bwd_sm90_splits_d(kHeadDim) && kScores == Scores::kRelBias) {
      return cudaErrorNotSupported;  // no bias kernel there (bwd_sm90_supports)
    } else if constexpr (kHeadDim == 512 && kScores != Scores::kPlain) {
      return cudaErrorNotSupported;  // d512: the plain kernel only (bwd_sm90_supports)
    } else {
      return bwd_sm90::launch<kIsBf16, kHeadDim, kScores>(p, stream);
    }
  });
}

}  // namespace hf_flash
