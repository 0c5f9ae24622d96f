// FlashAttention backward main kernel on Hopper (sm_90a), warp-specialised, d64, d128 and d256 (softcap and
// windows too, a relative bias at d64 / d128), no ALiBi / dropout (csrc/bwd handles those and every other GPU);
// deterministic mode orders the dQ additions with a counter per query block (below). Same preprocess, fp32 dQ
// accumulator, convert kernel and LSE / D conventions as csrc/bwd (attn/bwd_common.cuh; csrc/bwd.cu picks the kernel).
//
// One CTA (3 warpgroups) per (block of 128 keys, kv head, batch); K, V resident in smem, loop over the query
// heads of the GQA group and their query blocks:
//   producer  (24 registers): warp 0, lane 0 issues TMA loads of K, V once (kv_full) and of Q, dO per
//             (query head, query block) into a 2-stage ring; its 32 lanes store that block's LSE and D rows
//             (0 past the sequence) into the stage, scaled as the pointwise code takes them. A stage's "full"
//             mbarrier completes with the TMA bytes and the 32 lanes' arrivals, its "empty" one with the 256
//             consumer threads' arrivals once their last wgmma on it has retired. Warp 1, one lane: adds the dQ
//             tile to the fp32 accumulator (d64 / d128: one bulk reduction of the whole block; else kD / 32 TMA
//             reductions, cp.reduce.async.bulk.tensor) once its dq_full mbarrier completes, then releases it
//             (dq_empty); at d64 / d128 lane 0 of warp 2 takes every other step in deterministic mode, else it
//             stores the blocks warp 1 claimed (the first add into a block stores it; nothing zeroes them).
//   consumers (240 registers): warpgroup w owns keys 64w..64w+63. Per query block of kBlockM rows (d128 64,
//   d64 128):
//     S^T = K Q^T, dP^T = V dO^T             wgmma, both operands from smem
//     P^T = exp2(S^T scale log2e - LSE log2e), dS^T = P^T (dP^T - D) scale     in registers, branch-free; the
//                                            mask only in the tiles that need one (a compile-time variant)
//     dV += P^T dO, dK += dS^T Q             wgmma, P^T / dS^T as register A operands, dO / Q MN-major
//     dQ = dS K                              wgmma from dS^T stored to smem, stored as an fp32 tile for the
//                                            producer's reduction: both warpgroups' halves of dS^T form one
//       128-key tile (a 256-thread named barrier after the stores) and warpgroup w computes a 64 x 64 piece of
//       one dQ tile from it: columns 64w.. at d128, rows 64w.. at d64.
//     dV is issued right after P^T (it runs under the dS^T arithmetic; at d64 after one pass that makes P^T and
//     dS^T together, BwdSm90Traits::kOnePass), then dQ and dK; the dQ tile stores run under dK.
//   d256 (BwdSm90Traits::kDSplit): a CTA per 64 keys, both warpgroups on all of them, warpgroup w owning columns
//   128w.. of dK / dV and of dQ (two 64 x 64 pieces through its own fp32 slot); dO in one stage.
// Varlen: Q / dO / K / V rows past a sequence are the next sequence's rows (zero past the tensor), all masked
// (P = 0, dS = 0), so their dQ rows add 0 to the next sequence's (non-finite input there aside); K / V rows past
// it are not stored. Tiles are 128-byte swizzled panels (sm90/wgmma.cuh). Design: docs/design/backward-sm90.md.
#pragma once

#include "attn/bwd_common.cuh"
#include "sm90/schedule.cuh"
#include "sm90/store.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace hf_flash {
namespace bwd_sm90 {

template <bool kIsBf16, int kHeadDim, bool kRelBias>
struct BwdSm90Traits {
  // 128 keys x kBlockM queries. d128: 64 queries (dK, dV and S^T, dP^T fill the 240 registers). d64: 128 queries,
  // twice the arithmetic per operand load and per dQ reduction of 64 (1.17-1.19x), in registers with kOnePass.
  // d256 (kDSplit): 64 keys, which both warpgroups take whole, each owning half of d (columns 128 w ..) of dK and dV,
  // so a thread holds as many accumulators as at d128; S^T / dP^T and the pointwise pass are computed by both (1.4x
  // the tensor work of the five GEMMs). dO has one stage (its last reader, dV, is done mid-step), which leaves room
  // for a 64 x 64 fp32 dQ slot per warpgroup (adding dQ from registers, red.global, took 1.6-1.7x the time of no
  // adds at all). No bias (csrc/bwd.cu).
  // d512 (kCluster): two CTAs of a cluster, each this d256 kernel on its 256 columns of Q, K, V, dO, dQ, dK, dV;
  // S^T and dP^T are the sums of both CTAs' partials over their halves of d, exchanged through each other's shared
  // memory (the kernel's `exchange`). No duplicated GEMM beyond d256's; the exchange buffer and a ring of two dQ
  // slots (not three) per warpgroup fill the shared memory.
  static constexpr bool kCluster = kHeadDim == 512;
  static constexpr int kCtasPerTile = kCluster ? 2 : 1;  // the grid's CTAs per (key block, kv head, batch)
  // d rel_bias goes straight into drel_bias (launch.cuh: bwd::rel_bias_smem; bwd::RelBiasGrad's reductions): a
  // float add there is one instruction, into shared memory a compare-and-swap loop on sm_90.
  static constexpr bool kRelSumsInGmem = true;
  static constexpr bool kDSplit = bwd_sm90_splits_d(kHeadDim);
  static constexpr int kD = kCluster ? kHeadDim / 2 : kHeadDim;  // columns this CTA loads and owns
  static constexpr int kColumns = kHeadDim;                      // of the tensors
  static constexpr int kBlockN = kDSplit ? 64 : 128, kBlockM = bwd::sm90_block_m(kHeadDim);
  static constexpr bool kDqBlocked = bwd::sm90_dq_blocked(kHeadDim);  // dQ in register order (bwd_config.h)
  // Whole blocks: the first add into a dQ block stores it (bwd_config.h: sm90_first_add_stores). Outside
  // deterministic mode the first key block to reach it claims it (one acquire compare-and-swap, issued before its
  // tile is ready so that the round trip runs under the step) and hands the store to a storer lane (lane 0 of
  // warp 2), whose bulk group holds stores alone: the wait for a store's completion in the reducer's own group also
  // waited for its earlier reductions (docs/design/backward-sm90.md, "Claims at d128").
  static constexpr bool kFirstAddStores = bwd::sm90_first_add_stores(kHeadDim);
  static_assert(!kDqBlocked || kBlockM * kD == bwd::kDqBlockFloats, "a dQ block is one query block");
  static constexpr int kDv = kDSplit ? kD / 2 : kD;  // columns of dK / dV a warpgroup holds
  static_assert(kBlockM % bwd::kSm90BlockM == 0, "the dQ-order counters (bwd_config.h) cover every query block");
  static constexpr int kRelJ = kBlockM / 8;  // a consumer warp's tile: 16 keys x kBlockM queries
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256 || kHeadDim == 512, "instantiated head dims");
  static_assert(!kDSplit || !kRelBias, "the bias's sums would count each key twice");
  static_assert(kBlockN == (kDSplit ? 64 : 2 * 64), "two consumer warpgroups of 64 keys, or both on 64 keys");
  // dQ: the warpgroups' dS^T halves form one tile of the 128 keys, and warpgroup w computes a 64 x 64 piece of one
  // dQ tile over all of them (d64: one tile a query block, not one per warpgroup over its own keys, halves the
  // reductions: 1.04-1.06x). d256: two 64 x 64 pieces per warpgroup, one after the other (one m64n128 piece beside
  // dK and dV made ptxas serialise the d128 wgmmas).
  // The pieces go to the producer's reductions through fp32 slots of kDqSlotCols columns, a ring of kWgSlots per
  // owner: d256, each warpgroup a ring of three 32-column slots (a piece fills two, so a fill waits for the
  // reduction three fills back, not the one just before); else one tile for both warpgroups.
  static constexpr int kDqPieces = kDSplit ? 2 : 1, kDqOwners = kDSplit ? 2 : 1, kWgSlots = kDSplit ? 3 - kCluster : 1;
  static constexpr int kDqSlotCols = kDSplit ? 32 : kD, kFillsPerPiece = kDSplit ? 64 / kDqSlotCols : 1;
  static constexpr int kDqSlots = kDqOwners * kWgSlots, kDqFills = kDqPieces * kFillsPerPiece;  // fills a step
  // Whole blocks: the steps' fills alternate between two pairs of slot barriers, so that in deterministic mode two
  // reducer threads (lane 0 of warps 1 and 2) take the steps in turn: one waits for its reduction to complete (the
  // order's release) while the other already adds the next tile. Else one reducer takes both (a second measured
  // 0.99x at d128). The bias kernel is never deterministic: one pair (its d64 instance spilled 8 bytes more).
  // tools/model_dq_reducers.py models the hand-off and the order under random interleavings.
  static constexpr int kReducers = kDqBlocked && !kRelBias ? 2 : 1, kDqBars = kDqSlots * kReducers;
  static constexpr int kDqRing = kWgSlots * kReducers;  // an owner's fills before its first barrier pair recurs
  static_assert(kBlockM * kD == 2 * kDqPieces * 64 * 64, "64 x 64 pieces of dQ per warpgroup");
  // One pointwise pass after both S^T and dP^T: each element's P^T and dS^T packed into fragments as its fp32 values
  // die, so the peak is S^T + dP^T + dK + dV (192 registers at d64 x 128 rows; P^T fragments live beside all four
  // made ptxas spill and serialise the wgmmas), and dV waits for the pass. d128 keeps dV under the dS^T pass (one
  // pass there: 0.99-1.01x).
  static constexpr bool kOnePass = kBlockM == 128;
  // dS^T tiles: two (a warpgroup writes block it while the other's dQ wgmma may still read block it - 1), one with
  // the bias at d64, whose staging rows take the second's place (a barrier then waits for both dQ wgmmas instead).
  static constexpr int kDStBuffers = kRelBias && kBlockM == 128 ? 1 : 2;
  static constexpr int kThreads = 3 * 128, kConsumerThreads = 2 * 128, kStages = 2;
  static constexpr bool kOneDoStage = kDSplit;  // dO in its own one-stage buffer (do_full, do_empty)
  // 128 * 24 + 256 * 240 <= 64K registers.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // Named barriers of the two consumer warpgroups (0 is __syncthreads): the dS^T halves written, the single dS^T
  // buffer free again (the bias at d64).
  enum NamedBarrier { kDStWritten = 1, kDStFree = 2 };
  // Shared memory from a 1024-aligned base: K, V, the Q and dO rings, kDStBuffers dS^T tiles (kBlockN keys x
  // kBlockM), the dQ slots (d64 / d128: the tile in the consumers' order; else kDqSlotCols / 32 panels of kBlockM
  // rows x 32 fp32 each, the dq_acc map's boxes), the LSE
  // and D rings, then the mbarriers kv_full, full[kStages], empty[kStages], (dq_full, dq_empty)[kDqSlots], with one
  // dO stage do_full, do_empty, with the cluster x_full, x_empty, and the bias's floats. d512: the exchange buffer
  // after the dQ slots.
  static constexpr int kKVBytes = kBlockN * kD * 2, kQBytes = kBlockM * kD * 2, kDoStages = kOneDoStage ? 1 : kStages;
  static constexpr int kDStBytes = kBlockN * kBlockM * 2, kDqSlotBytes = kBlockM * kDqSlotCols * 4;
  static constexpr int kXBytes = kCluster ? kBlockN * kBlockM * 4 : 0;  // d512: the peer's partial S^T or dP^T
  static constexpr int kRowBytes = kBlockM * 4;
  static constexpr int kBarCount = 1 + 2 * kStages + 2 * kDqBars + 2 * kOneDoStage + 2 * kCluster + 2 * kFirstAddStores;
  static constexpr int kK = 0, kV = kKVBytes, kQ = 2 * kKVBytes, kDO = kQ + kStages * kQBytes,
                       kDSt = kDO + kDoStages * kQBytes, kDq = kDSt + kDStBuffers * kDStBytes,
                       kX = kDq + kDqSlots * kDqSlotBytes,
                       kLse = kX + kXBytes, kDsum = kLse + kStages * kRowBytes,
                       kBars = kDsum + kStages * kRowBytes,
                       kClaim = kBars + kBarCount * 8,  // the storer's mailbox: accumulator block, barrier pair
                       kRel = kClaim + 16,  // T5's bias: sums and staging rows (launch.cuh adds them)
                       kSmemBytes = kRel + 1024;              // + alignment slack
  static_assert(kDSt % 1024 == 0 && kDStBytes % 1024 == 0 && kDq % 1024 == 0, "swizzled panels");
  static_assert(kSmemBytes <= bwd::kSm90SmemOptin && (!kRelBias || bwd::rel_bias_fits_sm90(kSmemBytes, kRelJ)),
                "shared memory per block, d rel_bias included");
};

// TMA maps of q, dout, dq_acc (boxes of kBlockM rows) and k, v (kBlockN rows): dims (d, heads, rows, batch),
// 128-byte boxes (launch.cuh makes them; varlen tensors are one batch of total rows).
// A CTA's walk over its (query head, query block) pairs: the group's heads outer, the key block's query blocks
// inner (the bias's gradient sums one head at a time), first block first; deterministic d128 (`down`) walks the
// blocks last first with the heads inner, so every key block of a pair reaches (head, m) at the same step whatever
// its count of query blocks. With the heads outer, a causal pair's lighter key blocks finished a head sooner and
// waited at the next one for the heavier blocks before them in the order, holding their SMs.
// Where blocks are claimed (d64 / d128 outside deterministic mode) the walk starts at the query block of the key
// block's diagonal (`rot` blocks past the first) and wraps: causal key blocks start there anyway, and full
// attention's key blocks then reach a query block at different steps instead of all at once (their claims of one
// block, below, spread out).
template <bool kMayWalkDown>
struct QueryWalk {
  int head, mi;                         // the pair: query head, index among the key block's query blocks
  int head0, head_end, m_begin, m_count;
  bool ascending;  // deterministic mode adding in ascending key-block order: walks down, heads inner
  int rot;         // 0 without claims (deterministic mode's order starts every key block at its first block)
  __device__ __forceinline__ bool down() const { return kMayWalkDown && ascending; }
  __device__ __forceinline__ int m() const {
    const int up = mi + rot;
    return m_begin + (down() ? m_count - 1 - mi : up < m_count ? up : up - m_count);
  }
  __device__ __forceinline__ bool ends_head() const { return !down() && mi + 1 == m_count; }  // the head's last pair
  __device__ __forceinline__ void next() {
    if (down()) {
      head = head + 1 < head_end ? head + 1 : head0;
      mi += head == head0;
    } else {
      mi = mi + 1 < m_count ? mi + 1 : 0;
      head += mi == 0;
    }
  }
};

struct TmaMaps {
  CUtensorMap q, dout, k, v, dq_acc;
};

// kScores (flash.h): T5's relative bias and its gradient (p.rel_bias), softcap (p.softcap) or neither, each a
// kernel of its own: the bias's registers in the kernel without it made ptxas serialise the d128 wgmmas.
template <bool kIsBf16, int kHeadDim, Scores kScores>
__global__ void __launch_bounds__(BwdSm90Traits<kIsBf16, kHeadDim, kScores == Scores::kRelBias>::kThreads, 1)
    bwd_sm90_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ TmaMaps maps,
                const float* __restrict__ dsum, int* __restrict__ dq_counters, int group, float* __restrict__ dq_acc) {
#ifdef HF_SM90_ENABLED
  constexpr bool kRelBias = kScores == Scores::kRelBias, kSoftcap = kScores == Scores::kSoftcap;
  static_assert(kScores != Scores::kPlainOrRelBias, "one walk a backward kernel");
  using Tr = BwdSm90Traits<kIsBf16, kHeadDim, kRelBias>;
  constexpr int kD = Tr::kD, kBlockN = Tr::kBlockN, kBlockM = Tr::kBlockM, kStages = Tr::kStages;
  constexpr int kQBytes = Tr::kQBytes;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = tile::smem_u32(smem_raw), base = (raw + 1023) & ~1023u;
  float* s_lse = reinterpret_cast<float*>(smem_raw + (base - raw) + Tr::kLse);    // [stage][row] LSE
  float* s_dsum = reinterpret_cast<float*>(smem_raw + (base - raw) + Tr::kDsum);  // [stage][row] D
  const uint32_t sK = base + Tr::kK, sV = base + Tr::kV, kv_full = base + Tr::kBars;
  auto sQ = [&](int st) { return base + Tr::kQ + st * kQBytes; };
  auto sDO = [&](int st) { return base + Tr::kDO + st * kQBytes; };
  auto full = [&](int st) { return kv_full + 8 * (1 + st); };
  auto empty = [&](int st) { return kv_full + 8 * (1 + kStages + st); };
  // dQ slot w's barriers; with one dO stage, its pair after them.
  auto dq_full = [&](int w) { return kv_full + 8 * (1 + 2 * kStages + 2 * w); };
  auto dq_empty = [&](int w) { return dq_full(w) + 8; };
  const uint32_t do_full = dq_full(Tr::kDqBars), do_empty = do_full + 8, sDq = base + Tr::kDq;
  // Fill f of owner w: its slot of the ring, its barrier pair (whole blocks with two reducers: the fills alternate
  // pairs; else its slot's) and the parity of that pair's round.
  auto dq_slot = [](int w, int f) { return w * Tr::kWgSlots + f % Tr::kWgSlots; };
  auto dq_bar = [&](int w, int f) { return Tr::kReducers > 1 ? f % Tr::kReducers : dq_slot(w, f); };
  auto dq_parity = [](int f) { return (f / Tr::kDqRing) & 1; };
  // d512: the buffer the peer CTA's partials arrive in (x_full: its bytes; x_empty: the peer has read this CTA's).
  const uint32_t sX = base + Tr::kX, x_full = do_empty + 8, x_empty = x_full + 8;
  // A claimed block handed from the reducer to the storer: claim_full (the mailbox written), claim_empty (stored).
  const uint32_t claim_full = kv_full + 8 * (Tr::kBarCount - 2), claim_empty = claim_full + 8;  // the last two

  // Pairs (kv head, batch), blocks = key blocks: block 0 sees the most query blocks (sm90/schedule.cuh); packed
  // rows: pairs (kv head), blocks = packed key blocks (flash.h: packed_block0), so short sequences take no CTAs
  // for the key blocks they lack. d512: a cluster of two CTAs a tile, rank r owning columns 256 r .. of d.
  constexpr int kCtasPerTile = Tr::kCtasPerTile;
  const uint32_t rank = Tr::kCluster ? sm90::cluster_ctarank() : 0;
  const int col_base = Tr::kCluster ? kD * int(rank) : 0;
  const bool packed = p.cu_seqlens_k != nullptr;
  const int pairs = packed ? p.h_k : p.h_k * p.b, n_blocks = gridDim.x / kCtasPerTile / pairs;
  const sm90::SectionTile cta = sm90::section_tile(pairs, n_blocks, group, blockIdx.x / kCtasPerTile);
  // Deterministic mode (a counter per (query block, head) in dq_counters) orders the dQ additions into a
  // query block by key block, in the order the grid starts the key blocks, so a CTA only ever waits for CTAs that
  // started before it. d128 adds in ascending order (the grid's own, heaviest causal blocks first), each key block
  // walking its query blocks last first, heads inner (QueryWalk): every key block of a pair reaches (head, m) at the
  // same step.
  // d64 and d256 add in descending order with the grid reversed, walking up from the diagonal: each key block reaches
  // m one step after the one it waits for, 6-12% faster than ascending at causal d64 shapes of many waves
  // (docs/design/backward-sm90.md). But it starts the lightest causal blocks first, so a grid of under two waves (one
  // CTA an SM) ends on its heaviest: there d64 adds in ascending order (SmolLM2-sized calls 0.78 -> 0.96 of the
  // default).
  constexpr bool kMayAscend = kD <= 128;
  const bool ordered = p.deterministic;
  const bool ascending = kMayAscend && (kD == 128 || int(gridDim.x) < 2 * p.num_sms);
  const int block = ordered && !ascending ? n_blocks - 1 - cta.block : cta.block;
  const int hk = cta.pair % p.h_k, groups = p.h / p.h_k;
  const int b = packed ? packed_block_seq(p.cu_seqlens_k, p.b, p.total_k, block, kBlockN) : cta.pair / p.h_k;
  const bwd::Seq seq(p, b);
  const int n_block = packed ? int(block - packed_block0(seq.k0, b, kBlockN)) : block;
  const int n0 = n_block * kBlockN;
  if (n_block < 0 || n0 >= seq.sk) return;  // packed: a block no sequence owns (the whole CTA)
  const bwd::KeyBlock kb = bwd::query_blocks<kBlockN, kBlockM>(p, seq, n0);
  const int iters = groups * kb.m_count;  // (query head, query block) pairs
  const int head0 = hk * groups;
  // (The bias's gradient is never deterministic, binding.cpp: its kernel keeps the ascending walk and a register.)
  using Walk = QueryWalk<kMayAscend && !kRelBias>;
  const bool claims = Tr::kFirstAddStores && !ordered;  // the first key block to reach a dQ block stores it
  const Walk walk0{head0, 0, head0, head0 + groups, kb.m_begin, kb.m_count, ordered && ascending,
                   claims ? bwd::diagonal_offset<kBlockM>(p, seq, kb) : 0};
  // d rel_bias sums of one query head and the warps' staging rows, after the mbarriers (zeroed before the barrier
  // below).
  float* s_rel = reinterpret_cast<float*>(smem_raw + (base - raw) + Tr::kRel);
  using RelGrad = bwd::RelBiasGrad<Tr::kRelJ, Tr::kRelSumsInGmem>;
  if constexpr (kRelBias) RelGrad::zero(p, s_rel, threadIdx.x, Tr::kThreads);

  if (threadIdx.x == 0) {
    sm90::mbar_init(kv_full, 1);
    for (int st = 0; st < kStages; ++st) {
      sm90::mbar_init(full(st), 32);
      sm90::mbar_init(empty(st), Tr::kConsumerThreads);
    }
    for (int w = 0; w < Tr::kDqBars; ++w) {
      sm90::mbar_init(dq_full(w), Tr::kConsumerThreads / Tr::kDqOwners);
      sm90::mbar_init(dq_empty(w), 1);
    }
    if (Tr::kOneDoStage) {
      sm90::mbar_init(do_full, 1);
      sm90::mbar_init(do_empty, Tr::kConsumerThreads);
    }
    if (Tr::kFirstAddStores) {
      sm90::mbar_init(claim_full, 1);
      sm90::mbar_init(claim_empty, 1);
    }
    if (Tr::kCluster) {
      sm90::mbar_init(x_full, 1);                             // the arming thread; + the bytes
      sm90::mbar_init(x_empty, Tr::kConsumerThreads / 32);  // the peer's consumer warps
      sm90::mbar_arrive_expect_tx(x_full, Tr::kXBytes);     // exchange 0 (kernel.cuh: `exchange`)
    }
    sm90::mbar_init_fence();
  }
  if constexpr (Tr::kCluster) sm90::cluster_sync();  // both CTAs' barriers initialised before any remote access
  else __syncthreads();

  // ---- producer: warp 0 loads, lane 0 of warp 1 (deterministic d64 / d128: and of warp 2) adds the dQ tiles --
  if (threadIdx.x < 128) {
    sm90::regs_dealloc<Tr::kProducerRegs>();
    const int tma_b = p.cu_seqlens_q ? 0 : b;
    const int reducer = threadIdx.x / 32 - 1, reducers = ordered ? Tr::kReducers : 1;  // lanes 0 of warps 1, 2
    volatile int64_t* claim_box = reinterpret_cast<volatile int64_t*>(smem_raw + (base - raw) + Tr::kClaim);
    // The storer (claims: lane 0 of warp 2): stores each block the reducer claimed, frees its slot once read and
    // releases its counter (1 -> 2) once written, for the other key blocks' adds; until the reducer's end mark.
    if (claims && threadIdx.x == 64) {
      static_assert(!Tr::kFirstAddStores || Tr::kWgSlots == 1, "a claimed block is the one slot");
      for (int k = 0;; ++k) {
        sm90::mbar_wait(claim_full, k & 1);
        const int64_t acc_block = claim_box[0];
        if (acc_block < 0) break;
        sm90::bulk_store(dq_acc + acc_block * bwd::kDqBlockFloats, sDq, Tr::kDqSlotBytes);
        sm90::bulk_commit();
        sm90::bulk_wait_read<0>();
        sm90::mbar_arrive(dq_empty(int(claim_box[1])));
        sm90::bulk_wait<0>();
        sm90::counter_release_inc(dq_counters + acc_block);
        sm90::mbar_arrive(claim_empty);
      }
      return;
    }
    if (threadIdx.x % 32 == 0 && reducer >= 0 && reducer < reducers) {
      tile::grid_dependency_wait();  // the prologue zeroed the counters (d256 / d512: the accumulator)
      // Rows past a dense batch's seqlen_q fall outside the map (dropped); varlen rows past a sequence add 0.
      const int row0 = p.cu_seqlens_q ? seq.ws0 : 0;
      auto walk = walk0;
      const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;  // per (batch, head) in the d256 counters
      int pending = -1;  // kWgSlots > 1: the slot of the newest reduction, released after the next one's issue
      int claimed = 0;   // blocks handed to the storer
#pragma unroll 1  // the producer loops stay rolled: 24 registers
      for (int it = 0; it < iters; ++it, walk.next()) {
        if (it % reducers != reducer) continue;  // the other reducer's step
        const int m = walk.m(), head = walk.head;
        // Whole blocks (d64 / d128): block (query block, head) of the accumulator, and its counter where the first
        // add stores (bwd::sm90_first_add_stores): deterministic mode counts the adds; claims leave 0 untouched,
        // 1 being stored, 2 stored. Else (d256, d512) a counter per (batch, head, query block) in deterministic
        // mode only.
        const int64_t acc_block = Tr::kDqBlocked ? (bwd::dq_block0(p, b, seq.q0, kBlockM) + m) * p.h + head : 0;
        int* counter = Tr::kFirstAddStores ? dq_counters + acc_block
                       : ordered ? dq_counters + (int64_t(b) * p.h + head) * m_blocks + m
                                 : nullptr;
        bool store = false;
        if (ordered) {  // deterministic: wait for the adds of the key blocks before this one in the order
          const int before = ascending ? n_block - bwd::first_key_block<kBlockN, kBlockM>(p, seq, m)
                                            : bwd::last_key_block<kBlockN, kBlockM>(p, seq, m) - n_block;
          sm90::counter_wait(counter, before);
          store = Tr::kDqBlocked && before == 0;
        } else if (claims) {  // before the tile is ready, so that the round trip runs under the consumers' step
          const int seen = sm90::counter_claim(counter);
          store = seen == 0;
          if (seen == 1) sm90::counter_wait</*kAtLeast=*/true>(counter, 2);  // its claimer has stored it
        }
        // Fill k of owner w's ring (d256: warpgroup w's columns 128 w + 32 k ..; else the whole tile).
        for (int k = 0; k < Tr::kDqFills; ++k) {
          for (int w = 0; w < Tr::kDqOwners; ++w) {
            const int fill = it * Tr::kDqFills + k, slot = dq_slot(w, fill);
            const int bar = dq_bar(w, fill);
            sm90::mbar_wait(dq_full(bar), dq_parity(fill));
            if constexpr (Tr::kDqBlocked) {  // the whole block, in the consumers' order, with one bulk copy
              static_assert(Tr::kDqFills == 1 && Tr::kDqOwners == 1, "one fill a block");
              if (claims && store) {  // the storer's (one fill a block: this ends the step)
                if (claimed > 0) sm90::mbar_wait(claim_empty, (claimed - 1) & 1);  // the mailbox is free
                claim_box[0] = acc_block;
                claim_box[1] = bar;
                sm90::mbar_arrive(claim_full);
                ++claimed;
                continue;
              }
              float* dst = dq_acc + acc_block * bwd::kDqBlockFloats;
              if (store) sm90::bulk_store(dst, sDq + slot * Tr::kDqSlotBytes, Tr::kDqSlotBytes);
              else sm90::bulk_reduce_add_f32(dst, sDq + slot * Tr::kDqSlotBytes, Tr::kDqSlotBytes);
            } else {
              const int col0 = col_base + (Tr::kDSplit ? Tr::kDv * w + Tr::kDqSlotCols * k : 0);
              for (int panel = 0; panel < Tr::kDqSlotCols / 32; ++panel) {
                sm90::tma_reduce_add_4d(&maps.dq_acc, sDq + slot * Tr::kDqSlotBytes + panel * kBlockM * 128,
                                        col0 + panel * 32, head, row0 + m * kBlockM, tma_b);
              }
            }
            sm90::bulk_commit();
            if constexpr (Tr::kWgSlots > 1) {  // the slot before is free once all but this reduction have read
              if (pending >= 0) {
                sm90::bulk_wait_read<1>();
                sm90::mbar_arrive(dq_empty(pending));
              }
              pending = slot;
            } else {  // one slot: free it now (the consumers' next fill waits for it)
              sm90::bulk_wait_read<0>();
              sm90::mbar_arrive(dq_empty(bar));
            }
          }
        }
        if (ordered) {
          sm90::bulk_wait<0>();  // the additions (or the store) are done: the next key block may add
          if (pending >= 0) sm90::mbar_arrive(dq_empty(pending));
          pending = -1;
          sm90::counter_release_inc(counter);
        }
      }
      if (claims) {  // the end mark, once the storer has read the last block's mailbox
        if (claimed > 0) sm90::mbar_wait(claim_empty, (claimed - 1) & 1);
        claim_box[0] = -1;
        sm90::mbar_arrive(claim_full);
      }
      sm90::bulk_wait<0>();  // the additions are done before the thread exits
    }
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {
      sm90::mbar_arrive_expect_tx(kv_full, 2 * Tr::kKVBytes);
      for (int panel = 0; panel < kD / 64; ++panel) {
        const int c = col_base + panel * 64;
        sm90::tma_load_4d(sK + panel * kBlockN * 128, &maps.k, kv_full, c, hk, seq.k0 + n0, tma_b);
        sm90::tma_load_4d(sV + panel * kBlockN * 128, &maps.v, kv_full, c, hk, seq.k0 + n0, tma_b);
      }
    }
    tile::grid_dependency_wait();  // D (the prologue's dot_do_o_kernel) is read below; K / V load meanwhile
    auto walk = walk0;
#pragma unroll 1
    for (int it = 0; it < iters; ++it, walk.next()) {
      const int st = int(unsigned(it) % kStages), m0 = walk.m() * kBlockM, head = walk.head;  // it >= 0: unsigned %
      // This block's LSE and D rows, loaded before the stage is free (rows past the end read as 0; they are masked).
      const float* lse = p.lse + (p.cu_seqlens_q ? head * p.lse_head_stride + seq.q0
                                                 : b * p.lse_batch_stride + head * p.lse_head_stride);
      const float* d = dsum + int64_t(head) * p.total_q + seq.ws0;
      float lse_r[kBlockM / 32], d_r[kBlockM / 32];
#pragma unroll
      for (int i = 0; i < kBlockM / 32; ++i) {
        const int r = m0 + lane + 32 * i;
        lse_r[i] = r < seq.sq ? lse[r] : 0.f;
        d_r[i] = r < seq.sq ? d[r] : 0.f;
      }
      if (it >= kStages) sm90::mbar_wait(empty(st), (it / kStages - 1) & 1);
      if (lane == 0) {
        sm90::mbar_expect_tx(full(st), (Tr::kOneDoStage ? 1 : 2) * kQBytes);
        for (int panel = 0; panel < kD / 64; ++panel) {
          const int c = col_base + panel * 64;
          sm90::tma_load_4d(sQ(st) + panel * kBlockM * 128, &maps.q, full(st), c, head, seq.q0 + m0, tma_b);
          if (!Tr::kOneDoStage) {
            sm90::tma_load_4d(sDO(st) + panel * kBlockM * 128, &maps.dout, full(st), c, head, seq.q0 + m0, tma_b);
          }
        }
      }
      // Stored scaled as the pointwise code takes them (LSE in log2 units, D times the softmax scale), so the
      // consumers do not rescale them every block (1 multiply per element pair of their tiles).
#pragma unroll
      for (int i = 0; i < kBlockM / 32; ++i) {
        s_lse[st * kBlockM + lane + 32 * i] = lse_r[i] * bwd::kLog2e;
        s_dsum[st * kBlockM + lane + 32 * i] = d_r[i] * p.softmax_scale;
      }
      sm90::mbar_arrive(full(st));  // release: the stores above are visible to the consumers' wait
      if (Tr::kOneDoStage) {  // dO after the stage's release: the consumers free it after dV, mid-step
        if (it > 0) sm90::mbar_wait(do_empty, (it - 1) & 1);
        if (lane == 0) {
          sm90::mbar_arrive_expect_tx(do_full, kQBytes);
          for (int panel = 0; panel < kD / 64; ++panel) {
            sm90::tma_load_4d(sDO(0) + panel * kBlockM * 128, &maps.dout, do_full, col_base + panel * 64, head,
                              seq.q0 + m0, tma_b);
          }
        }
      }
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------------
  sm90::regs_alloc<Tr::kConsumerRegs>();
  tile::grid_dependency_wait();  // d rel_bias / d sinks were zeroed or written by the prologue
  const int tid = threadIdx.x - 128, wg = sm90::warpgroup_index() - 1, warp = tid / 32 % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  const KeyWindow w(p, seq.sq, seq.sk);
  constexpr bool kDSplit = Tr::kDSplit;
  constexpr int kDv = Tr::kDv;
  float dv[kDv / 8][4] = {}, dk[kDv / 8][4] = {};  // this warpgroup's 64 keys x kDv (GQA: summed over the group)
  const int wg_keys = kDSplit ? 0 : 64 * wg;        // this warpgroup's keys: n0 + wg_keys ..
  const int key0 = n0 + wg_keys + 16 * warp + g;  // this thread's keys: key0, key0 + 8
  // dQ: this warpgroup's rows of the dS^T tile (wg_keys..: its keys) and its 64 x 64 piece (row0_dq, col0) of the
  // kBlockM x kD dQ tile, split by columns at d128 (64 rows) and by rows at d64 (128 rows); the panel of K it
  // multiplies.
  const int col0 = kD == 64 ? 0 : kD / 2 * wg, row0_dq = kD == 64 ? 64 * wg : 0;
  const uint32_t k_dq = sK + (col0 / 64) * kBlockN * 128;
  const int dkv_col0 = kDSplit ? kDv * wg : 0;  // this warpgroup's columns of dK / dV (and of Q / dO they take)
  // dQ tile stores (d256 / d512; d64 / d128 store in register order, store_dq): row r = row0_dq + 16 warp + g +
  // 8 h2 (r % 8 = g), columns c = slot_col0 + 8 j + 2 t, + 1 in
  // panel c / 32 of its slot, 16-byte chunk (c % 32) / 4 = 2 (j % 4) + t / 2 stored at chunk ^ g: one XOR by
  // (j % 4) << 5 per j. A half-warp serves a 64-bit store: rows g and g ^ 1 would put column groups j on the same
  // banks, so odd rows store group j ^ 2 where even rows store j (bank-conflict-free; ncu counted 2-way conflicts
  // otherwise). d256: warpgroup wg's ring, each fill at its slot's column 0.
  const int dq_owner = kDSplit ? wg : 0, slot_col0 = kDSplit ? 0 : col0;
  const bool dq_swap = g & 1;
  const uint32_t dq_x =
      (sDq + (row0_dq + 16 * warp + g) * 128 + (((t / 2) ^ g) << 4) + (t % 2) * 8) ^ (dq_swap << 6);
  auto walk = walk0;  // at iteration it
  sm90::mbar_wait(kv_full, 0);     // also: no TMA lands after the CTA (iters == 0)

  // d512: S^T (or dP^T) = this CTA's partial over its 256 columns + the peer's. Exchange k (two a step: S^T, then
  // dP^T) is pushed by warpgroup k % 2 of each CTA (both hold the same partial) into the other's buffer X, 16
  // bytes a store in thread order (the receiver's fragments have the same layout), completing the receiver's
  // x_full; both receiving warpgroups add it, and their 8 warps free X with a remote arrival on the sender's
  // x_empty, which the sender's next push waits for. One thread arms x_full for exchange k + 1 as soon as k has
  // arrived: before its own warp frees X, so before the peer can push k + 1 (the bytes never precede the arming).
  [[maybe_unused]] const uint32_t peer = rank ^ 1u;
  auto exchange = [&](float (&acc)[kBlockM / 8][4], int k) {
    if constexpr (Tr::kCluster) {
      const uint32_t chunk = (tid % 128) * 16;
      if (wg == k % 2) {
        if (k > 0) sm90::mbar_wait(x_empty, (k - 1) & 1);  // the peer has read push k - 1
        const uint32_t dst = sm90::cluster_map(sX + chunk, peer), bar = sm90::cluster_map(x_full, peer);
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) sm90::st_async_v4(dst + j * 128 * 16, acc[j], bar);
      }
      sm90::mbar_wait(x_full, k & 1);
      if (tid == 0) sm90::mbar_arrive_expect_tx(x_full, Tr::kXBytes);  // exchange k + 1
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const uint4 x = tile::ld_shared_v4(sX + chunk + j * 128 * 16);
        acc[j][0] += __uint_as_float(x.x);
        acc[j][1] += __uint_as_float(x.y);
        acc[j][2] += __uint_as_float(x.z);
        acc[j][3] += __uint_as_float(x.w);
      }
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive_remote(sm90::cluster_map(x_empty, peer));
    }
  };

  // One (query head, query block) of the walk. `masked` (compile-time): some (key, row) pair of the tile is not
  // visible, so P^T goes through the mask; the tiles inside every mask, most of them, take the instance without
  // the mask code (a third of the pointwise instructions).
  // d rel_bias of the one-column warps (RelBias::block_column) of this query head: columns 0 and 2R.
  [[maybe_unused]] float sat_lo = 0.f, sat_hi = 0.f;
  auto step = [&](int it, int m0, auto masked) {
    const int st = int(unsigned(it) % kStages);  // it >= 0: no sign fix-up
    const uint32_t q_s = sQ(st), do_s = sDO(Tr::kOneDoStage ? 0 : st);
    const uint32_t dst = base + Tr::kDSt + it % Tr::kDStBuffers * Tr::kDStBytes;  // dS^T tile
    const float* lse_st = s_lse + st * kBlockM;
    const float* dsum_st = s_dsum + st * kBlockM;
    // A warp whose 16 keys x the block's rows all lie past the table's radius on one side reads one column
    // (RelBias::block_column; most warps at long S): the bias is then one value and its d logits one sum, so its
    // passes run without the per-element columns and the staging. Its value is loaded here, before the waits, so
    // its latency runs under the wgmmas instead of after them.
    [[maybe_unused]] int sat_col = -1;
    [[maybe_unused]] float sat_bias2 = 0.f;  // log2 units
    if constexpr (kRelBias) {
      const RelBias rb(p, walk.head, seq.sq, seq.sk);
      sat_col = rb.block_column(m0, m0 + kBlockM - 1, key0 - g, key0 - g + 15);
      if (sat_col >= 0) sat_bias2 = bwd::kLog2e * __ldg(rb.table + sat_col);
    }
    sm90::mbar_wait(full(st), int(unsigned(it) / kStages) & 1);

    // The rows' LSE / D (scaled by the producer) in registers before the Sᵀ wgmma is issued: loaded after it, behind
    // its shared-memory reads, each row group's first FFMA waited for its load (11-18% of the d128 warps' stall
    // samples, ncu). Column group j (rows 8 j + 2 t, + 1) is needed by the 8 lanes of one t. d128 loads all 8 groups
    // of LSE (its D loads go under dV's issue). d64 (16 groups, one pass) loads groups g and g + 8 of both and takes
    // group j from lane 4 (j % 8) + t with shuffles (kShuffle): 8 lanes loading the same values made 268 M
    // shared-memory wavefronts at full 16k, 18% of the kernel's (docs/design/backward-sm90.md). The d64 bias kernel
    // shuffles in its one-column warps (kSatShuffle; T5's encoder at 4 x 4096 1.04x), its diagonal warps load each
    // group in the pass (shuffling there too, ptxas spilled 172 bytes); the d64 softcap kernel loads its first 2
    // groups here, the rest in the pass.
    constexpr bool kShuffle = Tr::kOnePass && kScores == Scores::kPlain;
    constexpr bool kSatShuffle = Tr::kOnePass && kRelBias, kPreShuffled = kShuffle || kSatShuffle;
    constexpr int kLoaded = Tr::kOnePass ? 2 : kBlockM / 8;
    float2 lse2_pre[kLoaded], dsum_pre[kLoaded] = {};  // (d128 sets dsum_pre after dV's issue)
    auto lse2_load = [&](int j) { return *reinterpret_cast<const float2*>(lse_st + 8 * j + 2 * t); };
    auto dsum_load = [&](int j) { return *reinterpret_cast<const float2*>(dsum_st + 8 * j + 2 * t); };
#pragma unroll
    for (int i = 0; i < kLoaded; ++i) lse2_pre[i] = lse2_load(kPreShuffled ? g + 8 * i : i);
    if constexpr (Tr::kOnePass) {
#pragma unroll
      for (int i = 0; i < kLoaded; ++i) dsum_pre[i] = dsum_load(kPreShuffled ? g + 8 * i : i);
    }

    // S^T = K Q^T and dP^T = V dO^T over d (this warpgroup's 64 key rows of K / V, all query rows of Q / dO),
    // K-major operands: k16 steps walk the 128-byte panel rows in 32 bytes; one commit group each.
    auto gemm_keys = [&](uint32_t sKeys, uint32_t sQueries, auto& acc) {
      const uint64_t a = sm90::desc(sKeys + wg_keys * 128, 16), bq = sm90::desc(sQueries, 16);
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        sm90::mma_ss<kBlockM, kIsBf16, 0, 0>(acc, sm90::k_major_step<kBlockN>(a, kk),
                                             sm90::k_major_step<kBlockM>(bq, kk), kk > 0);
      }
      sm90::commit();
    };
    // Accumulators declared per block, not zeroed: the first k step overwrites them, and nothing keeps them live
    // into the dQ phase (whose 32 registers per thread take their place).
    float s[kBlockM / 8][4], dp[kBlockM / 8][4];
    // (dO's wait before both: a wait loop between them made ptxas add a warpgroup.arrive before dP^T)
    if constexpr (Tr::kOneDoStage) sm90::mbar_wait(do_full, it & 1);
    sm90::fence();
    gemm_keys(sK, q_s, s);
    gemm_keys(sV, do_s, dp);

    // P^T (masked: causal diagonal, window edges, sequence ends) into the A fragments of dV += P^T dO.
    sm90::wait<1>();
    sm90::fence_operand(s);
    exchange(s, 2 * it);
    // Mask: P^T element (key0 + 8 h, row0 + c), c = 8 j + r % 2, h = r / 2, is visible iff first <= c - 8 h and
    // c < last[h] (rows row_lo .. row_hi see a key, and row_lo moves with it), a branch-free compare pair against
    // immediates (short-circuit row / key tests compile to one small branch per element, each a stall before dV
    // can issue); three registers, as many as without windows.
    const int row0 = m0 + 2 * t, first = w.row_lo(key0) - row0;
    int last[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key0 + 8 * h;
      last[h] = key >= seq.sk ? INT_MIN : min(seq.sq, w.row_hi(key) + 1) - row0;
    }
    uint32_t pa[kBlockM / 16][4], dsa[kBlockM / 16][4];  // A fragments of dV and dK
    // Per element (j, r) of this thread's tile: P^T from S^T (masked) with the row's LSE in log2 units, dS^T from P^T
    // and dP^T with the row's D scaled; per column group j: the fragments (pa, dsa) and the dS^T tile stores.
    auto shuffled = [&](float2 v, int j) {  // group j, from the lane that loaded it
      const int src = 4 * (j % 8) + t;
      return make_float2(__shfl_sync(~0u, v.x, src), __shfl_sync(~0u, v.y, src));
    };
    // Group j of the rows' LSE (pre = lse2_pre, load = lse2_load) or D, in a one-column warp (sat) or not.
    auto group_of = [&](auto sat, const auto& pre, auto load, int j) {
      if constexpr (kShuffle || (kSatShuffle && decltype(sat)::value)) return shuffled(pre[j / 8], j);
      else if constexpr (kSatShuffle) return load(j);  // pre holds groups g, g + 8: of no use without shuffles
      else return j < kLoaded ? pre[j] : load(j);
    };
    auto lse2_of = [&](auto sat, int j) { return group_of(sat, lse2_pre, lse2_load, j); };
    auto dsum_of = [&](auto sat, int j) { return group_of(sat, dsum_pre, dsum_load, j); };
    // Softcap: the logits of group j capped in place (softcap tanh(s scale / softcap); the scale is then log2(e)), and
    // d cap / d s / scale = 1 - tanh^2 into dtanh, which dS^T takes on (the P^T of dV stays uncapped by it).
    [[maybe_unused]] const float scale_over_cap = kSoftcap ? p.softmax_scale / p.softcap : 0.f;
    auto cap_logits = [&](int j, float (&dtanh)[4]) {
      if constexpr (kSoftcap) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float th = tile::fast_tanh(s[j][r] * scale_over_cap);
          s[j][r] = p.softcap * th;
          dtanh[r] = 1.f - th * th;
        }
      }
    };
    auto prob = [&](int j, int r, float lse2) {
      const int c = 8 * j + r % 2;
      const float e = tile::fast_exp2(fmaf(s[j][r], p.softmax_scale_log2, -lse2));
      if constexpr (!decltype(masked)::value) return e;
      return (c - 8 * (r / 2) >= first) & (c < last[r / 2]) ? e : 0.f;
    };
    auto grad_logit = [&](int j, int r, float2 dsc) {
      return s[j][r] * fmaf(dp[j][r], p.softmax_scale, r % 2 ? -dsc.y : -dsc.x);
    };
    auto pack_p = [&](int j) {
      pa[j / 2][(j % 2) * 2] = tile::pack2<kIsBf16>(s[j][0], s[j][1]);
      pa[j / 2][(j % 2) * 2 + 1] = tile::pack2<kIsBf16>(s[j][2], s[j][3]);
    };
    // The dS^T tile, rows wg_keys + 16 warp .. + 15 (keys), 16-byte chunks of 8 query columns: one stmatrix x4 per
    // pair of column groups (2kk, 2kk + 1), whose registers dsa[kk] already are in its order (rows 0-7, 8-15) x
    // (chunk 2kk, 2kk + 1). Lane 8q + r addresses row r + 8 (q % 2) of chunk 2kk + q / 2, swizzled by the row
    // (r): with 2kk even, the chunk's XOR is (q / 2) ^ r per lane and (2kk % 8) per pair, one XOR a store.
    const uint32_t ds_lane = dst + (wg_keys + 16 * warp + lane / 8 % 2 * 8 + lane % 8) * 128 +
                             (((lane / 16) ^ (lane % 8)) << 4);
    auto pack_store_ds = [&](int j, const float (&ds)[4]) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) dsa[j / 2][(j % 2) * 2 + h2] = tile::pack2<kIsBf16>(ds[2 * h2], ds[2 * h2 + 1]);
      const int kk = j / 2;  // d256: both warpgroups hold the whole tile; each stores half of its columns
      if (j % 2 == 1 && (!kDSplit || kk / (kBlockM / 32) == wg)) {
        tile::stmatrix_x4((ds_lane ^ ((2 * kk % 8) << 4)) + (2 * kk / 8) * kBlockN * 128, dsa[kk]);
      }
    };
    // dV += P^T dO: k16 steps are 16 query rows (2048 bytes) of the MN-major dO panels.
    auto issue_dv = [&] {
      const uint64_t do_desc = sm90::desc(do_s + (dkv_col0 / 64) * kBlockM * 128, kBlockM * 128);
      sm90::fence();
      sm90::fence_operand(dv);
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk)
        sm90::mma_rs<kDv, kIsBf16, 1>(dv, pa[kk], sm90::desc_add(do_desc, kk * 2048), true);
      sm90::commit();
    };
    // The pointwise passes are straight-line code, the bias's a compile-time variant (kRelBias): a branch on it inside
    // the unrolled loops cut them into basic blocks the scheduler could not interleave (1.25x the d64 backward's
    // time; 3% at d128).
    RelGrad rel(s_rel, p, walk.head, seq, 1.f / p.softmax_scale);  // this warp's 16 keys
    if constexpr (kRelBias) rel.begin(p, s_rel, tid / 32, key0 - g, m0, g, t);
    // One-column warps (sat_col >= 0) take warp-uniform branches around the loops only: the waits and wgmmas stay
    // on one path.
    static_assert(kBlockM - 1 + 15 <= kRelBiasPad, "bin_bias reads a non-saturated block unclamped");
    auto by_column = [&](auto loop) {  // loop(sat): sat = std::true_type for a one-column warp
      if constexpr (kRelBias) {
        if (sat_col >= 0) loop(std::true_type{});
        else loop(std::false_type{});
      } else {
        loop(std::false_type{});
      }
    };
    // The bias joins the logit: subtract it from the LSE instead. Element (j, r) is bin j + 1 - r / 2 of parity
    // r % 2 (RelBiasGrad).
    auto lse2_at = [&](auto sat, int j, int r, float2 l2) {
      float lse2 = r % 2 ? l2.y : l2.x;
      if constexpr (decltype(sat)::value) lse2 -= sat_bias2;
      else if constexpr (kRelBias) lse2 -= bwd::kLog2e * rel.bin_bias(j + 1 - r / 2, r % 2);
      return lse2;
    };
    // d rel_bias of a pass's d logits: staged by diagonal (added by commit() under the dQ / dK wgmmas), or, in a
    // one-column warp, summed into this thread's total of that column (added once a query head).
    auto rel_pass = [&](auto sat, auto&& each_j) {
      [[maybe_unused]] float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        each_j(j, [&](const float (&ds)[4]) {
          if constexpr (decltype(sat)::value) sum += (ds[0] + ds[1]) + (ds[2] + ds[3]);
          else if constexpr (kRelBias) rel.step(j, ds);
        });
      }
      if constexpr (decltype(sat)::value) (sat_col == 0 ? sat_lo : sat_hi) += sum;
      else if constexpr (kRelBias) rel.finish();
    };
    if constexpr (Tr::kOnePass) {
      sm90::wait<0>();  // dP^T too
      sm90::fence_operand(dp);
      if constexpr (Tr::kDStBuffers == 1) {  // both dQ wgmmas of it - 1 have read the tile
        if (it > 0) sm90::named_barrier_sync(Tr::kDStFree, Tr::kConsumerThreads);
      }
      by_column([&](auto sat) {
        rel_pass(sat, [&](int j, auto&& rel_step) {
          const float2 l2 = lse2_of(sat, j), dsc = dsum_of(sat, j);
          float ds[4], dtanh[4];
          cap_logits(j, dtanh);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            s[j][r] = prob(j, r, lse2_at(sat, j, r, l2));
            ds[r] = grad_logit(j, r, dsc);
            if constexpr (kSoftcap) ds[r] *= dtanh[r];
          }
          rel_step(ds);
          pack_p(j);
          pack_store_ds(j, ds);
        });
      });
      issue_dv();
    } else {
      by_column([&](auto sat) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
          const float2 l2 = lse2_of(sat, j);
          float dtanh[4];
          cap_logits(j, dtanh);
#pragma unroll
          for (int r = 0; r < 4; ++r) s[j][r] = prob(j, r, lse2_at(sat, j, r, l2));
          pack_p(j);
          if constexpr (kSoftcap) {  // P^T (1 - tanh^2) from here on: the dS^T pass multiplies by it
#pragma unroll
            for (int r = 0; r < 4; ++r) s[j][r] *= dtanh[r];
          }
        }
      });
      issue_dv();  // now, so that it runs under the dS^T arithmetic
#pragma unroll
      for (int j = 0; j < kLoaded; ++j) dsum_pre[j] = dsum_load(j);  // under dP^T's wgmma

      // dS^T = P^T (dP^T - D) scale into the A fragments of dK += dS^T Q, the dS^T tile for dQ and the d rel_bias
      // sums.
      sm90::wait<1>();  // dP^T (dV may still run)
      sm90::fence_operand(dp);
      exchange(dp, 2 * it + 1);
      by_column([&](auto sat) {
        rel_pass(sat, [&](int j, auto&& rel_step) {
          const float2 dsc = dsum_of(sat, j);
          float ds[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) ds[r] = grad_logit(j, r, dsc);
          rel_step(ds);
          pack_store_ds(j, ds);
        });
      });
    }
    sm90::fence_proxy_async();  // this thread's dS^T stores, visible to wgmma after the barrier
    sm90::named_barrier_sync(Tr::kDStWritten, Tr::kConsumerThreads);  // both halves of dS^T written

    // dQ piece (64 x 64) = dS K over kBlockN keys: the dS^T panel of its 64 queries (MN-major A), K rows (MN-major B);
    // then dK += dS^T Q.
    float dq[8][4];
    const uint64_t q_desc = sm90::desc(q_s + (dkv_col0 / 64) * kBlockM * 128, kBlockM * 128);
    const uint64_t ds_desc = sm90::desc(dst + (row0_dq / 64) * kBlockN * 128, kBlockN * 128);
    auto issue_dq = [&](int piece) {
      if (piece > 0) sm90::fence();  // dq read by the stores since the last wgmma
      const uint64_t k_desc = sm90::desc(k_dq + piece * kBlockN * 128, kBlockN * 128);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        sm90::mma_ss<64, kIsBf16, 1, 1>(dq, sm90::desc_add(ds_desc, kk * 2048), sm90::desc_add(k_desc, kk * 2048),
                                        kk > 0);
      sm90::commit();
    };
    sm90::fence();  // dsa written since the last wgmma
    sm90::fence_operand(dk);
    issue_dq(0);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      sm90::mma_rs<kDv, kIsBf16, 1>(dk, dsa[kk], sm90::desc_add(q_desc, kk * 2048), true);
    sm90::commit();
    if constexpr (kRelBias) {  // d rel_bias under the dQ and dK wgmmas
      if (sat_col < 0) rel.commit();
    }
    sm90::wait<1>();  // dQ (and dV) done; dK runs under the dQ tile stores
    sm90::fence_operand(dq);
    if constexpr (Tr::kOneDoStage) sm90::mbar_arrive(do_empty);  // dV has read dO
    // Fill f of this warpgroup's ring (f counts over the walk: column groups j0 .. of dq) once the reducer has read
    // the fill kWgSlots before it from the same slot.
    constexpr int kFillJ = 8 / Tr::kFillsPerPiece;
    auto store_dq = [&](int f, int j0) {
      const int slot = dq_slot(dq_owner, f);
      if (f >= Tr::kWgSlots) {  // the slot's fill before (f - kWgSlots, one round of the ring back) has been read
        const int before = f - Tr::kWgSlots + Tr::kDqRing;  // + a whole ring: no negative division
        sm90::mbar_wait(dq_empty(dq_bar(dq_owner, before)), (before / Tr::kDqRing - 1) & 1);
      }
      if constexpr (Tr::kDqBlocked) {  // this warpgroup's half: its thread i's chunk j at (128 j + i) x 16 bytes
        const uint32_t piece = sDq + slot * Tr::kDqSlotBytes + wg * (Tr::kDqSlotBytes / 2) + (threadIdx.x % 128) * 16;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          tile::st_shared_v4(piece + j * 128 * 16, make_uint4(__float_as_uint(dq[j][0]), __float_as_uint(dq[j][1]),
                                                              __float_as_uint(dq[j][2]), __float_as_uint(dq[j][3])));
        }
        sm90::fence_proxy_async();
        sm90::mbar_arrive(dq_full(dq_bar(dq_owner, f)));
        return;
      }
      const uint32_t x0 = dq_x + slot * Tr::kDqSlotBytes;  // slots are 1024-byte multiples: dq_x's XOR holds
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
        for (int jj = 0; jj < kFillJ; ++jj) {  // this lane's group: j ^ 2 on odd rows (dq_x carries its address bit)
          const int j = j0 + jj;
          const uint32_t addr =
              ((x0 + 8 * h2 * 128) ^ ((jj % 4) << 5)) + (slot_col0 / 32 + jj / 4) * kBlockM * 128;
          const float x = dq_swap ? dq[j ^ 2][2 * h2] : dq[j][2 * h2];
          const float y = dq_swap ? dq[j ^ 2][2 * h2 + 1] : dq[j][2 * h2 + 1];
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y));
        }
      }
      sm90::fence_proxy_async();  // the stores, visible to the TMA reductions
      sm90::mbar_arrive(dq_full(dq_bar(dq_owner, f)));
    };
#pragma unroll
    for (int piece = 0; piece < Tr::kDqPieces; ++piece) {  // d256: the next piece's wgmma, then its stores
      if (piece > 0) {
        issue_dq(piece);
        sm90::wait<0>();
        sm90::fence_operand(dq);
      }
#pragma unroll
      for (int half = 0; half < Tr::kFillsPerPiece; ++half)
        store_dq((it * Tr::kDqPieces + piece) * Tr::kFillsPerPiece + half, half * kFillJ);
    }
    sm90::wait<0>();
    sm90::fence_operand(dv);
    sm90::fence_operand(dk);
    sm90::mbar_arrive(empty(st));  // this thread's wgmmas on stage st and its LSE / D reads are done
    // This head's one-column warps' totals. The sums are drel_bias itself (kRelSumsInGmem), so there is nothing
    // to flush.
    if (kRelBias && walk.ends_head()) {
      rel.add_block(0, sat_lo);
      rel.add_block(rel.rb.width - 1, sat_hi);
      sat_lo = sat_hi = 0.f;
    }
  };
  for (int it = 0; it < iters; ++it, walk.next()) {
    const int m0 = walk.m() * kBlockM;
    if (w.covers(m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1)) step(it, m0, std::false_type{});
    else step(it, m0, std::true_type{});
  }

  tile::grid_launch_dependents();  // the convert kernel's CTAs may take the SMs of CTAs that finish (it waits)
  // d512: the CTA stays until the peer has read its last push (the peer's arrival lands in this CTA's x_empty).
  if (Tr::kCluster && wg == 1 && iters > 0) sm90::mbar_wait(x_empty, (2 * iters - 1) & 1);

  // dV, then dK, through this warp's 16 rows of the V tile (this warpgroup's rows are read by its dP^T alone).
  const int warp_key = wg_keys + 16 * warp;  // this warp's keys: n0 + warp_key ..
  using Elem = typename tile::Elem<kIsBf16>::T;
  const float one[2] = {1.f, 1.f};
  const int64_t row = seq.k0 + n0 + warp_key;
  const uint32_t staging = sV + (dkv_col0 / 64) * kBlockN * 128;  // d256: each warpgroup its panels of its columns
  sm90::store_rows<kIsBf16, kDv, kBlockN>(dv, one, staging, warp_key,
                                          static_cast<Elem*>(p.dv) + p.dv_batch_stride * b + row * p.dv_row_stride +
                                              hk * p.dv_head_stride + col_base + dkv_col0,
                                          p.dv_row_stride, seq.sk - n0 - warp_key);
  sm90::store_rows<kIsBf16, kDv, kBlockN>(dk, one, staging, warp_key,
                                          static_cast<Elem*>(p.dk) + p.dk_batch_stride * b + row * p.dk_row_stride +
                                              hk * p.dk_head_stride + col_base + dkv_col0,
                                          p.dk_row_stride, seq.sk - n0 - warp_key);
#endif  // HF_SM90_ENABLED
}

}  // namespace bwd_sm90
}  // namespace hf_flash
