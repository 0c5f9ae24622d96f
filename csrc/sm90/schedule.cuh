// CTA order of the Hopper kernels (generic: no attention code here): a 1-D grid of (pair, block) tiles, where
// a pair's blocks are the CTAs that share its data in L2, numbered heaviest first: the backward's key blocks of a
// (kv head, batch), sharing Q / dO; the forward's query blocks of a (head, batch), sharing K / V. Tiles run in
// sections of `group` pairs, the block the slowest index within a section. Causal blocks differ in work; with
// one pair's blocks in a row (group 1) the last pairs' heavy blocks start late and run alone at the end of the
// grid. A section of enough pairs lets its light blocks balance its heavy ones across the SMs; too many pairs
// and the CTAs of a wave no longer share their pair's data in L2 (docs/design/backward-sm90.md).
#pragma once
#include <algorithm>
#include <cstdint>

namespace hf_flash {
namespace sm90 {

struct SectionTile {
  int pair, block;  // block 0: the pair's heaviest
};

// `index`: the CTA's tile in the grid (blockIdx.x, or the cluster's index with clusters).
__host__ __device__ __forceinline__ SectionTile section_tile(int pairs, int blocks, int group,
                                                          unsigned index = blockIdx.x) {
  const int section = index / (group * blocks), r = index - section * group * blocks;
  const int in_section = min(group, pairs - section * group);  // the last section may hold fewer pairs
  return {section * group + r % in_section, r / in_section};
}

// Persistent CTAs: a pair's blocks folded into couples (f, blocks - 1 - f), of equal work when the work falls
// linearly with the block (causal), dealt round-robin over the grid; a CTA runs both halves of a couple in a row.
// Folded tile u: couple u / 2, half u % 2; block -1 is the missing half of an odd count's middle couple.
struct FoldedTiles {
  int blocks, couples;  // couples per pair
  __host__ __device__ __forceinline__ FoldedTiles(int blocks_) : blocks(blocks_), couples((blocks_ + 1) / 2) {}
  __device__ __forceinline__ int first() const { return 2 * blockIdx.x; }
  __device__ __forceinline__ int next(int u) const { return u % 2 ? u - 1 + 2 * gridDim.x : u + 1; }
  __device__ __forceinline__ SectionTile at(int u) const {
    const int couple = u / 2, pair = couple / couples, f = couple - pair * couples;
    const int block = u % 2 ? blocks - 1 - f : f;
    return {pair, u % 2 && block == f ? -1 : block};
  }
};

// Persistent CTAs with few tiles: couples dealt round-robin leave SMs idle in a partial last round (2.18 couples a
// CTA: the CTAs with 3 run 1.38x the mean). Instead every pair's blocks, heaviest first (block 0 of each pair, then
// block 1, ...), are dealt in rounds of gridDim.x, alternately forward and backward over the CTAs (a snake: greedy
// longest-first without a counter). Simulated on causal work, 72 pairs x 8 blocks on 132 SMs: the busiest CTA at
// 1.02x the mean. Tile s: pair s % pairs, block s / pairs.
struct SnakeTiles {
  int pairs;
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int s) const {
    const int round = s / int(gridDim.x) + 1;
    return round * gridDim.x + (round % 2 ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  }
  __device__ __forceinline__ SectionTile at(int s) const { return {s % pairs, s / pairs}; }
};
// Whether persistent CTAs deal tiles by SnakeTiles: when the couples' rounds would keep the grid under 90% busy.
// Where they balance, couples keep a CTA on one pair's K / V and measured faster (forward, Llama 8 x 1024 with 16
// heads, 3.9 couples a CTA: the snake 0.94x).
inline bool snake_deal(int64_t couples, int num_sms) {
  const int64_t rounds = (couples + num_sms - 1) / num_sms;
  return 10 * couples < 9 * rounds * num_sms;
}

// Pairs per section. Causal: a heavy block ~ `blocks` units of work, a section ~ pairs * blocks^2 / 2 units over
// num_sms, so 2 * num_sms / blocks pairs balance it; capped at `cap_bytes` of `pair_bytes` (what a pair's blocks
// share). Not causal: every block is alike, and one pair's blocks in a row share their data in L2 best - unless
// `ordered` (the deterministic backward: a pair's blocks add dQ in block order, so blocks started together wait in
// a chain of ~1 us links): then num_sms / kOrderedBlocksPerWave pairs a section, so a wave starts only about that
// many consecutive blocks of a pair and the later ones start behind the earlier ones' adds (2 a wave ran 1.37x
// slower at d64 2k / d128 1k, whose 64 pairs' Q, dO and fp32 dQ exceed L2; docs/design/backward-sm90.md).
constexpr int kOrderedBlocksPerWave = 4;
inline int section_group(bool causal, int pairs, int blocks, int num_sms, int64_t pair_bytes, int64_t cap_bytes,
                         bool ordered = false) {
  if ((!causal && !ordered) || blocks <= 0) return 1;
  const int64_t balance = causal ? (2 * int64_t(num_sms) + blocks - 1) / blocks
                                 : (int64_t(num_sms) + kOrderedBlocksPerWave - 1) / kOrderedBlocksPerWave;
  const int64_t cap = cap_bytes / std::max<int64_t>(1, pair_bytes);
  return int(std::max<int64_t>(1, std::min<int64_t>({balance, cap, pairs})));
}

}  // namespace sm90
}  // namespace hf_flash
