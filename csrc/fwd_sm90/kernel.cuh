// FlashAttention forward on Hopper warpgroup MMA (wgmma, sm_90a), for the cases fwd_sm90_supports (csrc/fwd.cu)
// names: causal, sliding-window or full attention, sinks, relative bias, softcap; the mma.sync kernel in fwd/ covers
// the rest.
//
// A tile is kBlockM = 128 (or 192) query rows of one (batch, head); a CTA owns one tile (or, persistent, walks
// several) and three (or four) warpgroups:
//   producer  (24 registers): one thread issues TMA loads of Q once a tile and of K / V per key block into
//             two-stage rings, each stage guarded by a "full" mbarrier (TMA bytes landed) and an "empty"
//             one (both consumers done with it);
//   consumers (240 registers; 160 with three): 64 query rows each, one m64 wgmma tile. They walk the visible key blocks
//             from the last to the first like fwd/kernel.cuh. Per key block:
//     S = Q K^T   wgmma, Q and K from shared memory (both K-major)
//     softcap or relative bias, mask, online softmax in registers on the accumulator layout (the sm80
//                 helpers: per warp the wgmma accumulator is the mma.m16n8 C fragment repeated along N)
//     O += P V    wgmma, P from registers (packed from S, no shuffles), V from shared memory (MN-major:
//                 the descriptor's transpose bit reads V's rows as B's K dimension)
// Each consumer issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back and places the softmax of block
// j between the waits for the two, rescaling O once the second has landed (ptxas places that second wait
// before the exponentials: docs/design/forward-sm90.md). The consumers take turns issuing their GEMMs (a
// scheduler barrier), so one's softmax runs under the other's GEMMs. The masked key blocks (the ends of the
// walk) and the relative bias are compile-time branches: the loop over the unmasked blocks has no mask code.
// The epilogue stages O in the warpgroup's rows of the Q tile and stores whole rows (sm90/store.cuh).
#pragma once
#include <cmath>
#include <type_traits>

#include "attn/fwd_math.cuh"
#include "flash.h"
#include "sm90/schedule.cuh"
#include "sm90/store.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "tile.cuh"

namespace hf_flash {
namespace fwd_sm90 {

// kConsumers warpgroups of 64 query rows: 2, or 3 (192-row CTAs; d64 only, where their registers fit; the
// launch picks, fwd_sm90/launch.cuh). kPersistent: one CTA per SM walks couples of tiles (sm90::FoldedTiles), its
// producer loading a tile's Q into a second buffer under the tile before. kScores: what the key-block walk does to
// S before the mask (flash.h).
// kSnake (persistent only): the tiles dealt by sm90::SnakeTiles instead of couples (few tiles; launch.cuh). A
// compile-time choice: the deal chosen at run time cost the couples kernel 1-2% (its code grew by 160 instructions).
template <bool kIsBf16_, int kHeadDim_, int kConsumers_ = 2, bool kPersistent_ = false,
          Scores kScores_ = Scores::kPlainOrRelBias, bool kSnake_ = false>
struct FwdSm90Traits {
  static constexpr bool kIsBf16 = kIsBf16_;
  using T = typename tile::Elem<kIsBf16>::T;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr Scores kScores = kScores_;
  static constexpr bool kSnake = kSnake_;
  static_assert(!kSnake || kPersistent_, "a deal of persistent CTAs");
  // Packed (varlen) rows: the one-tile kernels and the d128 snake (launch.cuh). Its tiles are (head, packed block)
  // (flash.h: packed_block0); the other persistent kernels are compiled without that search.
  static constexpr bool kTakesPacked = !kPersistent_ || (kSnake_ && kHeadDim_ == 128);
  using Snaked = FwdSm90Traits<kIsBf16_, kHeadDim_, kConsumers_, kPersistent_, kScores_, true>;  // launch.cuh's pick
  static_assert(kConsumers == 2 || (kConsumers == 3 && kHeadDim == 64 && !kPersistent_), "instantiated shapes");
  static constexpr int kThreads = (kConsumers + 1) * 128;  // + the producer warpgroup
  // d512 (kDSplit): both consumers on the same 64 query rows, warpgroup w owning O's columns 256w.. (its 128
  // registers, as at d256) and computing S over its half of d; the halves' fp32 sums meet through shared memory
  // (an exchange a key block), so both hold the whole S and the same softmax. docs/design/forward-sm90.md.
  static constexpr bool kDSplit = kHeadDim == 512;
  static_assert(!kDSplit || (kConsumers == 2 && !kPersistent_), "d512: two consumers, one CTA a tile");
  static constexpr int kBlockM = kDSplit ? 64 : kConsumers * 64;  // query rows per CTA
  static constexpr int kDv = kDSplit ? kHeadDim / 2 : kHeadDim;  // O's columns (and d of S) a consumer takes
  // Keys per main-loop step. d256: two stages of 80 keys fit beside a 128-row Q tile (FlashAttention-3's shape);
  // O takes 128 of a consumer's registers there. d512: one stage of 64 keys beside a 64-row Q tile (a step's
  // fixed latency, paid in lockstep by both consumers, dominates: 16-key steps ran 0.67x 32-key ones).
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : kHeadDim == 256 ? 80 : 64;
  static constexpr int kStages = kDSplit ? 1 : 2;
  // Per-warp view for the sm80 softmax helpers: one 16-row slab, n8 tiles of S and of O.
  static constexpr int kMTiles = 1, kNTiles = kBlockN / 8, kDTiles = kDv / 8;
  // O of 128 registers a thread (d256, d512): rows keep a stale max within 2^8 (fwd::softmax_step), so most
  // steps skip O's rescale, 128 multiplies on the path between two key blocks' GEMMs.
  static constexpr int kStaleLog2 = kDv >= 256 ? 8 : 0;
  // Registers per thread after setmaxnreg: 128 * 24 + kConsumers * 128 * kConsumerRegs <= 64K.
  static constexpr int kProducerRegs = 24, kConsumerRegs = kConsumers == 3 ? 160 : 240;
  static_assert(128 * kProducerRegs + kConsumers * 128 * kConsumerRegs <= 65536, "register file");

  // Shared memory: Q (one buffer a tile in flight), then K and V of each stage (swizzled wgmma tiles), d512's
  // exchange (the two warpgroups' fp32 S halves), then the mbarriers.
  static constexpr int kQBuffers = kPersistent ? 2 : 1;
  static constexpr int kSmemQ = kBlockM * kHeadDim * 2;
  static constexpr int kSmemKV = kBlockN * kHeadDim * 2;
  static constexpr int kSmemHalfS = kBlockM * kBlockN * 4, kSmemX = kDSplit ? 2 * kSmemHalfS : 0;
  // q_full[], q_empty[], k_full[], v_full[], k_empty[], v_empty[]; + 1024 bytes of alignment slack
  static constexpr int kBarriers = 2 * kQBuffers + 4 * kStages;
  static constexpr int kSmemBytes = kQBuffers * kSmemQ + kStages * 2 * kSmemKV + kSmemX + kBarriers * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of an SM (d256: no second Q buffer, so not persistent)");
  // Named barriers: 1 .. kConsumers take turns (below); kTileBarrier lines the consumers up between tiles;
  // kExchangeBarrier (d512): both halves of a key block's S written, then both read.
  static constexpr int kTileBarrier = kConsumers + 1, kExchangeBarrier = kConsumers + 2;

  static_assert(kHeadDim % 64 == 0, "whole 128-byte swizzle panels (one TMA box each)");
};

// TMA maps of q, k, v: dims (d, heads, rows, batch), boxes of 64 columns x one head x a tile of rows
// (launch.cuh makes them; varlen tensors are one batch of total rows).
struct TmaMaps {
  CUtensorMap q, k, v;
};

template <class Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TmaMaps maps, int group) {
#ifdef HF_SM90_ENABLED
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
  constexpr int kQBuffers = Tr::kQBuffers;
  constexpr bool kPersistent = Tr::kPersistent;

  extern __shared__ char smem[];
  const uint32_t sQ0 = (tile::smem_u32(smem) + 1023) & ~1023u;  // swizzle panels start 1024-aligned
  auto sQ = [&](int buf) { return sQ0 + buf * Tr::kSmemQ; };
  auto sK = [&](int stage) { return sQ(kQBuffers) + stage * 2 * Tr::kSmemKV; };
  auto sV = [&](int stage) { return sK(stage) + Tr::kSmemKV; };
  const uint32_t sX = sK(kStages), bars = sX + Tr::kSmemX;
  auto q_full = [&](int buf) { return bars + 8 * buf; };
  auto q_empty = [&](int buf) { return bars + 8 * (kQBuffers + buf); };
  auto k_full = [&](int stage) { return bars + 8 * (2 * kQBuffers + stage); };
  auto v_full = [&](int stage) { return bars + 8 * (2 * kQBuffers + kStages + stage); };
  auto k_empty = [&](int stage) { return bars + 8 * (2 * kQBuffers + 2 * kStages + stage); };
  auto v_empty = [&](int stage) { return bars + 8 * (2 * kQBuffers + 3 * kStages + stage); };

  // ---- the tiles: one CTA each, in sections of `group` (head, batch) pairs, or (persistent) couples of a pair's
  // query blocks of equal causal work, round-robin, or with few tiles (kSnake) every pair's blocks heaviest first
  // (sm90/schedule.cuh) ----
  const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  // Tiles: (head, batch, query block) dense, (head, packed block) packed (flash.h: packed_block0), so a packed
  // batch has no tiles for the query blocks its short sequences lack.
  constexpr bool kSnake = Tr::kSnake;
  const bool varlen = Tr::kTakesPacked && p.cu_seqlens_q != nullptr;
  const int pairs = varlen ? p.h : p.h * p.b, blocks = varlen ? int(packed_blocks(p.total_q, p.b, kBlockM)) : m_blocks;
  const sm90::FoldedTiles folded(m_blocks);
  const sm90::SnakeTiles snaked{pairs};
  const int first_tile = !kPersistent ? 0 : kSnake ? snaked.first() : folded.first();
  const int tiles = !kPersistent ? 1 : kSnake ? blocks * pairs : 2 * folded.couples * p.h * p.b;
  auto next_tile = [&](int tile) { return !kPersistent ? tiles : kSnake ? snaked.next(tile) : folded.next(tile); };
  // A tile's problem (as in fwd/kernel.cuh); empty when its query block is past its sequence (varlen).
  struct Tile {
    int head, batch, q_start, seqlen_q, k_start, seqlen_k, m0, m_last, n_block_min, n_block_max;
    KeyWindow w;
  };
  auto tile_at = [&](int tile) {
    const sm90::SectionTile st = !kPersistent ? sm90::section_tile(pairs, blocks, group)
                                 : kSnake     ? snaked.at(tile)
                                              : folded.at(tile);
    // st.block 0: the last query block (a sequence's longest causal rows); -1: none. Varlen: the last sequence's.
    const int block = blocks - 1 - st.block, head = st.pair % p.h;
    const int batch = varlen ? packed_block_seq(p.cu_seqlens_q, p.b, p.total_q, block, kBlockM) : st.pair / p.h;
    const int2 rows_q = seq_rows(p.cu_seqlens_q, batch, p.total_q, p.seqlen_q);
    // Packed: a block before the first sequence's first (cu_seqlens_q[0] > 0, invalid) repeats that block.
    const int m_block = varlen ? max(0, int(block - packed_block0(rows_q.x, batch, kBlockM))) : block;
    const int2 keys = fwd::key_range(p, batch);
    const KeyWindow w(p, rows_q.y, keys.y);
    const int m0 = m_block * kBlockM, m_last = min(m0 + kBlockM, rows_q.y) - 1;
    const int2 blocks = m0 < rows_q.y ? w.key_blocks(m0, m_last, kBlockN) : make_int2(0, 0);
    return Tile{head, batch, rows_q.x, rows_q.y, keys.x, keys.y, m0, m_last, blocks.x, blocks.y, w};
  };

  if (threadIdx.x == 0) {
    for (int buf = 0; buf < kQBuffers; ++buf) {
      sm90::mbar_init(q_full(buf), 1);
      sm90::mbar_init(q_empty(buf), Tr::kConsumers * 128);
    }
    for (int stage = 0; stage < kStages; ++stage) {
      sm90::mbar_init(k_full(stage), 1);
      sm90::mbar_init(v_full(stage), 1);
      sm90::mbar_init(k_empty(stage), Tr::kConsumers * 128);
      sm90::mbar_init(v_empty(stage), Tr::kConsumers * 128);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();

  // ---- producer: one thread issues every TMA load ------------------------------------------
  if (threadIdx.x < 128) {
    sm90::regs_dealloc<Tr::kProducerRegs>();
    if (threadIdx.x != 0) return;
    // The K / V ring runs on across tiles: step `it` counts every key block this CTA has loaded.
    for (int tile = first_tile, it = 0, q_it = 0; tile < tiles; tile = next_tile(tile)) {
      const Tile tl = tile_at(tile);
      if (tl.m0 >= tl.seqlen_q) continue;
      // Varlen tensors are one batch of total rows; rows past a sequence are masked (K), multiply P = 0
      // (V) or are not stored (Q); rows past the tensor read as zero.
      const int tma_batch = varlen ? 0 : tl.batch;
      const int head_k = tl.head / (p.h / p.h_k);
      const int buf = q_it % kQBuffers;
      if (q_it >= kQBuffers) sm90::mbar_wait(q_empty(buf), (q_it / kQBuffers - 1) & 1);  // its O rows are stored
      ++q_it;
      sm90::mbar_arrive_expect_tx(q_full(buf), Tr::kSmemQ);
      for (int panel = 0; panel < kHeadDim / 64; ++panel) {
        sm90::tma_load_4d(sQ(buf) + panel * kBlockM * 128, &maps.q, q_full(buf), panel * 64, tl.head,
                          tl.q_start + tl.m0, tma_batch);
      }
      for (int n_block = tl.n_block_max - 1; n_block >= tl.n_block_min; --n_block, ++it) {
        const int stage = it % kStages, reuse_phase = (it / kStages - 1) & 1, row = tl.k_start + n_block * kBlockN;
        if (it >= kStages) sm90::mbar_wait(k_empty(stage), reuse_phase);
        sm90::mbar_arrive_expect_tx(k_full(stage), Tr::kSmemKV);
        for (int panel = 0; panel < kHeadDim / 64; ++panel) {
          sm90::tma_load_4d(sK(stage) + panel * kBlockN * 128, &maps.k, k_full(stage), panel * 64, head_k, row,
                            tma_batch);
        }
        if (it >= kStages) sm90::mbar_wait(v_empty(stage), reuse_phase);
        sm90::mbar_arrive_expect_tx(v_full(stage), Tr::kSmemKV);
        for (int panel = 0; panel < kHeadDim / 64; ++panel) {
          sm90::tma_load_4d(sV(stage) + panel * kBlockN * 128, &maps.v, v_full(stage), panel * 64, head_k, row,
                            tma_batch);
        }
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------
  sm90::regs_alloc<Tr::kConsumerRegs>();
  if (p.rel_bias) tile::grid_dependency_wait();  // the bias table is written (launch_rel_bias_fill)
  const int wg = sm90::warpgroup_index() - 1, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // accumulator row / column pair within a warp's 16 x 8 tile
  const float scale_log2 = p.softmax_scale_log2;  // log2(e) with softcap (applied to the scaled scores)
  [[maybe_unused]] const float scale_over_cap = Tr::kScores == Scores::kSoftcap ? p.softmax_scale / p.softcap : 0.f;
  // kv_base: key blocks of the CTA's earlier tiles (the K / V ring runs on across tiles).
  for (int tile = first_tile, kv_base = 0, q_it = 0; tile < tiles; tile = next_tile(tile)) {
    const Tile tl = tile_at(tile);
    if (tl.m0 >= tl.seqlen_q) continue;
    const int head = tl.head, batch = tl.batch, q_start = tl.q_start, seqlen_q = tl.seqlen_q, m0 = tl.m0;
    const int n_block_max = tl.n_block_max;
    const KeyWindow& w = tl.w;
    const int buf = q_it % kQBuffers, q_phase = (q_it / kQBuffers) & 1;
    ++q_it;
    const int wg_rows = Tr::kDSplit ? 0 : wg * 64;  // this warpgroup's rows of the tile
    const int row0 = m0 + wg_rows + warp * 16 + g;
    auto row_of = [&](int, int half) { return row0 + half * 8; };

    float o[1][Tr::kDTiles][4] = {};
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}}, alpha[1][2];
    float s[1][Tr::kNTiles][4];
    uint32_t p_frag[1][kBlockN / 16][4];
    // This warpgroup's 64 rows; d512: its half of d (Q, K and V panels 4 wg ..).
    const int d_panel0 = Tr::kDSplit ? 4 * wg : 0;
    const uint64_t q_desc = sm90::desc(sQ(buf) + (Tr::kDSplit ? d_panel0 * kBlockM * 128 : wg * 64 * 128), 16);
    // Step `it` of the walk is key block n_block_max - 1 - it, in stage (kv_base + it) % kStages.
    auto stage_of = [&](int it) { return int(unsigned(kv_base + it) % kStages); };  // >= 0: no sign fix-up
    auto phase_of = [&](int it) { return int(unsigned(kv_base + it) / kStages) & 1; };
    auto issue_qk = [&](int it) {  // S = Q K^T
      sm90::mbar_wait(k_full(stage_of(it)), phase_of(it));
      sm90::fence();
      const uint64_t k_desc = sm90::desc(sK(stage_of(it)) + d_panel0 * kBlockN * 128, 16);
#pragma unroll
      for (int kk = 0; kk < Tr::kDv / 16; ++kk) {
        sm90::mma_ss<kBlockN, Tr::kIsBf16, 0, 0>(s[0], sm90::k_major_step<kBlockM>(q_desc, kk),
                                         sm90::k_major_step<kBlockN>(k_desc, kk), kk > 0);
      }
      sm90::commit();
    };
    auto issue_pv = [&](int it) {  // O += P V
      sm90::mbar_wait(v_full(stage_of(it)), phase_of(it));
      sm90::fence();
      const uint64_t v_desc = sm90::desc(sV(stage_of(it)) + d_panel0 * kBlockN * 128, kBlockN * 128);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        sm90::mma_rs<Tr::kDv, Tr::kIsBf16, 1>(o[0], p_frag[0][kk], v_desc + ((kk * 16 * 128) >> 4), true);
      }
      sm90::commit();
    };
    const RelBias rb(p, head, seqlen_q, tl.seqlen_k);
    auto key0 = [&](int it) { return (n_block_max - 1 - it) * kBlockN; };
    // Whether every (row, key) of step it is visible. The masked steps are a prefix of the walk (the causal
    // diagonal or a window's right edge, and the partial last key block) and a suffix (a window's left edge).
    auto unmasked = [&](int it) { return w.covers(m0, tl.m_last, key0(it), key0(it) + kBlockN - 1); };
    // On S of step it, landed; alpha for O. `masked` and `scores` are compile-time, so the loop of unmasked steps
    // carries no mask code and no branch between the two wgmma waits.
    auto softmax = [&](int it, auto masked, auto scores) {
      if constexpr (decltype(scores)::value == Scores::kSoftcap) fwd::apply_softcap(s, p.softcap, scale_over_cap);
      if constexpr (decltype(scores)::value == Scores::kRelBias) {
        fwd::add_rel_bias<16, Tr::kConsumers == 3>(s, rb, fwd::kLog2e / scale_log2, row0 - g, row0 - g + 15, key0(it),
                                                   t, row_of);
      }
      if constexpr (decltype(masked)::value) fwd::apply_mask(s, w, key0(it), t, row_of);
      fwd::softmax_step<Tr, Tr::kStaleLog2>(s, row_max, row_sum, alpha, scale_log2);
    };

    // The consumers take turns at the tensor cores (FlashAttention-3's scheduler barrier, named barriers
    // 1 .. kConsumers): each waits for its turn before issuing a step's two GEMMs and passes the turn on once they
    // are issued, so one warpgroup's softmax runs under the others' GEMMs instead of all contending at once.
    // Warpgroup 0 starts a tile with the turn; the last warpgroup does not pass it back after its last step, which
    // leaves every barrier with as many arrivals as waits. Between tiles (persistent) the consumers line up on
    // kTileBarrier first: a warpgroup a tile ahead would otherwise pass a turn the next one has not yet taken.
    // d512's consumers meet at every key block's exchange instead (no turns).
    const int steps = n_block_max - tl.n_block_min;
    constexpr int kTurnThreads = 2 * 128;  // the waiting warpgroup and the one passing the turn to it
    auto await_turn = [&] {
      sm90::named_barrier_sync(1 + wg, kTurnThreads);
    };
    auto pass_turn = [&](int it) {
      if (wg + 1 < Tr::kConsumers || it + 1 < steps) {
        sm90::named_barrier_arrive(1 + (wg + 1) % Tr::kConsumers, kTurnThreads);
      }
    };
    auto start_turns = [&] {
      if constexpr (kPersistent) sm90::named_barrier_sync(Tr::kTileBarrier, Tr::kConsumers * 128);
      if (wg == 0 && steps > 1) sm90::named_barrier_arrive(1, kTurnThreads);
    };
    // d512: S = this warpgroup's half + the other's, through one buffer a warpgroup (a second barrier once both
    // have read, before either writes again). Thread-linear 16-byte chunks (conflict-free); the sum is
    // commutative, so both warpgroups hold the same S and run the same softmax.
    auto exchange_s = [&] {
      if constexpr (Tr::kDSplit) {
        const int tid = threadIdx.x % 128;
        const uint32_t mine = sX + wg * Tr::kSmemHalfS + tid * 16;
        const uint32_t theirs = sX + (1 - wg) * Tr::kSmemHalfS + tid * 16;
#pragma unroll
        for (int j = 0; j < Tr::kNTiles; ++j) {
          tile::st_shared_v4(mine + j * 128 * 16, make_uint4(__float_as_uint(s[0][j][0]), __float_as_uint(s[0][j][1]),
                                                             __float_as_uint(s[0][j][2]), __float_as_uint(s[0][j][3])));
        }
        sm90::named_barrier_sync(Tr::kExchangeBarrier, Tr::kConsumers * 128);
#pragma unroll
        for (int j = 0; j < Tr::kNTiles; ++j) {
          const uint4 x = tile::ld_shared_v4(theirs + j * 128 * 16);
          s[0][j][0] += __uint_as_float(x.x);
          s[0][j][1] += __uint_as_float(x.y);
          s[0][j][2] += __uint_as_float(x.z);
          s[0][j][3] += __uint_as_float(x.w);
        }
        sm90::named_barrier_sync(Tr::kExchangeBarrier, Tr::kConsumers * 128);
      }
    };

    // One step of the walk (it >= 1): S_it = Q K_it^T and O += P_{it-1} V_{it-1} back to back, the softmax of
    // S_it between the waits for the two, O rescaled once the second has landed.
    auto step = [&](int it, auto masked, auto scores) {
      sm90::fence_operand(o);
      sm90::fence_operand(p_frag);
      await_turn();
      issue_qk(it);
      issue_pv(it - 1);
      pass_turn(it);
      sm90::wait<1>();  // S landed; P V may still run
      sm90::fence_operand(s);
      sm90::mbar_arrive(k_empty(stage_of(it)));
      softmax(it, masked, scores);
      sm90::wait<0>();
      sm90::fence_operand(o);
      sm90::fence_operand(p_frag);
      sm90::mbar_arrive(v_empty(stage_of(it - 1)));
      // With stale maxima, a warp whose rows all kept theirs skips the rescale (alpha == 1).
      if (Tr::kStaleLog2 == 0 || __any_sync(~0u, alpha[0][0] != 1.f || alpha[0][1] != 1.f)) {
        fwd::rescale_o<Tr>(o, alpha);
      }
      fwd::pack_p<Tr>(p_frag, s);
    };
    // d512, one K / V stage: P_it V_it right after the softmax instead of under the next step's S (that order would
    // leave V_it's stage held through step it + 1, so V_{it+1} could not load before it is needed). Nothing in
    // flight between steps; K_{it+1} loads under this step's exchange, softmax and P V, V_{it+1} under S_{it+1}.
    auto step_dsplit = [&](int it, auto masked, auto scores) {
      sm90::fence_operand(o);
      issue_qk(it);
      sm90::wait<0>();
      sm90::fence_operand(s);
      sm90::mbar_arrive(k_empty(stage_of(it)));
      exchange_s();
      softmax(it, masked, scores);
      // A warp whose rows all kept their max (alpha == 1, fwd::softmax_step) skips the rescale.
      if (it > 0 && __any_sync(~0u, alpha[0][0] != 1.f || alpha[0][1] != 1.f)) fwd::rescale_o<Tr>(o, alpha);
      fwd::pack_p<Tr>(p_frag, s);
      sm90::fence_operand(o);
      sm90::fence_operand(p_frag);
      issue_pv(it);
      sm90::wait<0>();
      sm90::fence_operand(o);
      sm90::mbar_arrive(v_empty(stage_of(it)));
    };
    // d512 walks its steps with step_dsplit, the others with step (the same masked / unmasked loop written for
    // each: one loop as a shared helper changed the d64 / d128 code, ptxas spilling 288 bytes at d64).
    auto walk = [&](auto scores) {
      if constexpr (Tr::kDSplit) {
        for (int it = 0; it < steps;) {
          if (!unmasked(it)) {
            step_dsplit(it++, std::true_type{}, scores);
          } else {
            for (; it < steps && unmasked(it); ++it) step_dsplit(it, std::false_type{}, scores);
          }
        }
      } else {
        if (steps == 0) return;
        issue_qk(0);
        sm90::wait<0>();
        sm90::fence_operand(s);
        sm90::mbar_arrive(k_empty(stage_of(0)));
        if (unmasked(0)) softmax(0, std::false_type{}, scores);  // O is still 0: no rescale
        else softmax(0, std::true_type{}, scores);
        fwd::pack_p<Tr>(p_frag, s);
        start_turns();
        // The masked steps one at a time, the unmasked ones in a loop of their own (one instance of each step: a
        // third for the window's left edge made ptxas spill with three consumer warpgroups).
        for (int it = 1; it < steps;) {
          if (!unmasked(it)) {
            step(it++, std::true_type{}, scores);
          } else {
            for (; it < steps && unmasked(it); ++it) step(it, std::false_type{}, scores);
          }
        }
        sm90::fence_operand(o);
        sm90::fence_operand(p_frag);
        issue_pv(steps - 1);
        sm90::wait<0>();
        sm90::fence_operand(o);
        sm90::mbar_arrive(v_empty(stage_of(steps - 1)));  // the next tile's loads reuse the stage
      }
    };
    sm90::mbar_wait(q_full(buf), q_phase);
    if constexpr (Tr::kScores == Scores::kPlainOrRelBias) {
      if (rb.table) walk(std::integral_constant<Scores, Scores::kRelBias>{});
      else walk(std::integral_constant<Scores, Scores::kPlain>{});
    } else {
      walk(std::integral_constant<Scores, Tr::kScores>{});
    }
    kv_base += steps;

    // ---- epilogue: normalise, LSE; O through this warpgroup's rows of the Q tile (dead after its last S) ----
    float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + q_start;
    const float* sink = p.sinks ? p.sinks + head : nullptr;
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const fwd::RowNorm n = fwd::row_norm(row_max[0][half] * scale_log2, tile::quad_sum(row_sum[0][half]), sink);
      inv[half] = n.inv;
      if (t == 0 && (!Tr::kDSplit || wg == 0) && row_of(0, half) < seqlen_q) lse[row_of(0, half)] = n.lse;
    }
    const int warp_row = wg_rows + warp * 16;  // this warp's rows of the Q tile: query rows m0 + warp_row ..
    // d512: each warpgroup its columns, staged in its own panels of Q.
    T* out = static_cast<T*>(p.o) + batch * p.o_batch_stride + int64_t(q_start + m0 + warp_row) * p.o_row_stride +
             head * p.o_head_stride + d_panel0 * 64;
    sm90::store_rows<Tr::kIsBf16, Tr::kDv, kBlockM>(o[0], inv, sQ(buf) + d_panel0 * kBlockM * 128, warp_row, out,
                                                    p.o_row_stride, seqlen_q - m0 - warp_row);
    if constexpr (kPersistent) {  // this thread is done with the staged O: the next Q may land (through TMA)
      sm90::fence_proxy_async();
      sm90::mbar_arrive(q_empty(buf));
    }
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __trap();  // compiled for sm_90 without the "a" features: run_fwd_sm90_hdim must not pick this build
#endif
}

}  // namespace fwd_sm90
}  // namespace hf_flash
