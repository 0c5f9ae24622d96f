// Host checks of the Hopper kernels' CTA order (csrc/sm90/schedule.cuh), run by tests/test_schedule.py where nvcc
// is installed (no GPU needed). The deterministic backward's order rests on them: every tile of the grid is one
// (pair, block) exactly once, and a pair's block n - 1 has a smaller tile index than its block n, so a CTA only ever
// waits for CTAs that started before it (csrc/bwd_sm90/kernel.cuh).
#include <cstdio>
#include <vector>

#include "sm90/schedule.cuh"

using namespace hf_flash::sm90;

static int failures = 0;
#define CHECK(cond, ...)                          \
  do {                                            \
    if (!(cond)) {                                \
      std::printf("FAIL %s: ", #cond);            \
      std::printf(__VA_ARGS__);                   \
      std::printf("\n");                          \
      ++failures;                                 \
    }                                             \
  } while (0)

static void check_grid(int pairs, int blocks, int group) {
  std::vector<int> last(pairs, -1), seen(int64_t(pairs) * blocks, 0);
  for (int i = 0; i < pairs * blocks; ++i) {
    const SectionTile t = section_tile(pairs, blocks, group, unsigned(i));
    CHECK(t.pair >= 0 && t.pair < pairs && t.block >= 0 && t.block < blocks, "pairs %d blocks %d group %d tile %d",
          pairs, blocks, group, i);
    if (t.pair < 0 || t.pair >= pairs || t.block < 0 || t.block >= blocks) continue;
    ++seen[int64_t(t.pair) * blocks + t.block];
    CHECK(t.block == last[t.pair] + 1, "pairs %d blocks %d group %d: pair %d block %d after block %d", pairs, blocks,
          group, t.pair, t.block, last[t.pair]);
    last[t.pair] = t.block;
  }
  for (int64_t x = 0; x < int64_t(pairs) * blocks; ++x) {
    CHECK(seen[x] == 1, "pairs %d blocks %d group %d: tile of pair %d block %d seen %d times", pairs, blocks, group,
          int(x / blocks), int(x % blocks), seen[x]);
  }
}

int main() {
  const int num_sms = 132;
  for (int pairs : {1, 2, 3, 7, 24, 33, 64, 256}) {
    for (int blocks : {1, 2, 5, 8, 16, 128}) {
      for (bool causal : {false, true}) {
        for (bool ordered : {false, true}) {
          for (int64_t pair_bytes : {int64_t(1) << 18, int64_t(1) << 20, int64_t(8) << 20}) {
            const int group = section_group(causal, pairs, blocks, num_sms, pair_bytes, int64_t(32) << 20, ordered);
            CHECK(group >= 1 && group <= pairs, "group %d of %d pairs", group, pairs);
            if (!causal && !ordered) CHECK(group == 1, "full attention, not ordered: group %d", group);
            // ordered full attention: at most kOrderedBlocksPerWave of a pair's blocks a wave, unless the section
            // holds every pair or one more pair would pass the byte cap
            if (!causal && ordered) {
              const int64_t cap = int64_t(32) << 20;
              CHECK(group == 1 || int64_t(group) * pair_bytes <= cap, "group %d of %lld bytes past the cap", group,
                    (long long)pair_bytes);
              CHECK(group == pairs || int64_t(group + 1) * pair_bytes > cap ||
                        (num_sms + group - 1) / group <= kOrderedBlocksPerWave,
                    "ordered full attention: group %d leaves %d blocks of a pair a wave", group,
                    (num_sms + group - 1) / group);
            }
            check_grid(pairs, blocks, group);
          }
        }
      }
      for (int group = 1; group <= pairs && group <= 40; ++group) check_grid(pairs, blocks, group);
    }
  }
  std::printf("%s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
