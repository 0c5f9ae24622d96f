// CTA order of the Hopper backward (generic: no attention code here): a 1-D grid of (pair, block) tiles, where
// a pair is a (kv head, batch) and its blocks are the CTAs of that pair, numbered heaviest first. Tiles run in
// sections of `group` pairs, the block the slowest index within a section. Causal blocks differ in work; with
// one pair's blocks in a row (group 1) the last pairs' heavy blocks start late and run alone at the end of the
// grid. A section of enough pairs lets its light blocks balance its heavy ones across the SMs; too many pairs
// and the CTAs of a wave no longer share their pair's data (Q / dO) in L2 (docs/design/backward-sm90.md).
#pragma once
#include <algorithm>
#include <cstdint>

namespace hf_flash {
namespace sm90 {

struct SectionTile {
  int pair, block;  // block 0: the pair's heaviest
};

__device__ __forceinline__ SectionTile section_tile(int pairs, int blocks, int group) {
  const int section = blockIdx.x / (group * blocks), r = blockIdx.x - section * group * blocks;
  const int in_section = min(group, pairs - section * group);  // the last section may hold fewer pairs
  return {section * group + r % in_section, r / in_section};
}

// Pairs per section. Causal: a heavy block ~ `blocks` units of work, a section ~ pairs * blocks^2 / 2 units over
// num_sms, so 2 * num_sms / blocks pairs balance it; capped at 32 MiB of `pair_bytes` (what a pair's blocks
// share). Not causal: every block is alike, and one pair's blocks in a row share their data in L2 best.
inline int section_group(bool causal, int pairs, int blocks, int num_sms, int64_t pair_bytes) {
  if (!causal || blocks <= 0) return 1;
  const int64_t balance = (2 * int64_t(num_sms) + blocks - 1) / blocks;
  const int64_t cap = (int64_t(32) << 20) / std::max<int64_t>(1, pair_bytes);
  return int(std::max<int64_t>(1, std::min<int64_t>({balance, cap, pairs})));
}

}  // namespace sm90
}  // namespace hf_flash
