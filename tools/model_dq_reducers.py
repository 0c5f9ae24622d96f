"""Random-interleaving model of the Hopper backward's dQ hand-off for whole blocks (d64 / d128,
csrc/bwd_sm90/kernel.cuh): in each CTA (a key block) the consumers write fill f into the one dQ slot once fill
f - 1 has been read, and arrive on barrier pair f % 2; deterministic mode's two reducer lanes take the fills in
turn (the default: one lane takes all), each waiting for its fill's dq_full, then (deterministic) for the counter
of its query block to say that every key block before it in the order has added, reading the slot into an
asynchronous reduction, freeing the slot (dq_empty), waiting for its reduction to complete and releasing the
counter. CTAs start in grid order, at most `resident` at a time; reductions complete late and out of order. The grid
holds `pairs` (kv head, batch) pairs of `key_blocks` each, in sections of `group` pairs with the block index
slowest (csrc/sm90/schedule.cuh's section_tile, mirrored below). Fails on a deadlock, a slot read before its fill
was written or after it was overwritten, or (deterministic) a query block's additions landing out of the key
blocks' order. `mutation` drops one rule (MUTATIONS), to show the model catches its absence (tests/test_tools.py).
Causal: key block n walks query blocks n .. m_blocks - 1, last first (d128's causal walk); full attention: all.
  python3 tools/model_dq_reducers.py"""
import random


class MBar:  # arrival count 1 a phase (the consumers' 256 arrivals, or the reducer's one, as one)
    def __init__(s): s.phase = 0
    def arrive(s): s.phase += 1
    def done(s, parity): return (s.phase & 1) != parity  # try_wait.parity


# The rules a mutation drops: the two barrier pairs (both reducers on pair 0, waiting with fill & 1 as one reducer
# does); the consumers' wait for fill f - 1's read; the reducer's wait for its reduction to complete before it
# releases the counter; the grid starting a pair's key blocks in the order's (blocks_reversed: last first).
MUTATIONS = ("one_barrier_pair", "no_empty_wait", "release_before_complete", "blocks_reversed")


def section_tile(pairs, blocks, group, index):
    """Tile `index` of the grid: (pair, key block), sections of `group` pairs, block index slowest."""
    section = index // (group * blocks)
    r = index - section * group * blocks
    in_section = min(group, pairs - section * group)
    return section * group + r % in_section, r // in_section


def run(key_blocks, m_blocks, resident, deterministic, seed, mutation=None, pairs=1, group=1, causal=True):
    assert mutation in (None, *MUTATIONS), mutation
    rng = random.Random(seed)
    reducers = 2 if deterministic else 1
    tiles = [section_tile(pairs, key_blocks, group, i) for i in range(pairs * key_blocks)]
    if mutation == "blocks_reversed":
        tiles = [(p, key_blocks - 1 - n) for p, n in tiles]
    counters = {(p, m): 0 for p in range(pairs) for m in range(m_blocks)}
    landed = {pm: [] for pm in counters}  # key blocks whose additions into (pair, m) completed, in order
    inflight = []  # (cta, reducer, query block)
    ctas = {}

    def pair(f):
        return 0 if mutation == "one_barrier_pair" else f % 2

    def parity(f):
        return f & 1 if mutation == "one_barrier_pair" else (f // 2) & 1

    def consumers(i):
        c = ctas[i]
        for f, m in enumerate(c['walk']):
            if f >= 1 and mutation != "no_empty_wait":
                while not c['empty'][pair(f - 1)].done(parity(f - 1)): yield
            assert c['slot'] is None or c['slot'][1], f"tile {c['tile']}: fill {c['slot'][0]} overwritten before its read"
            c['slot'] = [f, False]
            yield
            c['full'][pair(f)].arrive()

    def reducer(i, r):
        c = ctas[i]
        p, n = c['tile']
        for f, m in enumerate(c['walk']):
            if f % reducers != r:
                continue
            while not c['full'][pair(f)].done(parity(f)): yield
            if deterministic:
                while counters[(p, m)] != n: yield  # ascending order: the pair's key blocks 0 .. n - 1 added into m
            assert c['slot'] == [f, False], f"tile {c['tile']}: reducer {r} read {c['slot']} for fill {f}"
            c['slot'][1] = True
            inflight.append((i, r, m))
            c['pending'][r] += 1
            yield
            c['empty'][pair(f)].arrive()
            if deterministic:
                if mutation != "release_before_complete":
                    while c['pending'][r]: yield
                counters[(p, m)] += 1
        while c['pending'][r]: yield

    progs, started = {}, 0
    steps = 0
    while started < len(tiles) or progs or inflight:
        steps += 1
        assert steps <= 400000, f"deadlock: {started} of {len(tiles)} tiles started"
        if started < len(tiles) and len({k[0] for k in progs}) < resident:
            i, (p, n) = started, tiles[started]
            started += 1
            ctas[i] = dict(tile=(p, n), walk=list(range(m_blocks - 1, n - 1 if causal else -1, -1)), slot=None,
                           pending=[0, 0], full=[MBar(), MBar()], empty=[MBar(), MBar()])
            progs[(i, 'c')] = consumers(i)
            for r in range(reducers):
                progs[(i, r)] = reducer(i, r)
            continue
        choices = list(progs) + (['done'] if inflight else [])
        ch = rng.choice(choices)
        if ch == 'done':
            i, r, m = inflight.pop(rng.randrange(len(inflight)))
            p, n = ctas[i]['tile']
            landed[(p, m)].append(n)
            ctas[i]['pending'][r] -= 1
        else:
            try:
                next(progs[ch])
            except StopIteration:
                del progs[ch]
    for (p, m), order in landed.items():
        if deterministic:
            assert order == sorted(order), f"pair {p}, query block {m}: additions landed in order {order}"
        assert sorted(order) == list(range(min(m, key_blocks - 1) + 1 if causal else key_blocks)), (p, m, order)


if __name__ == "__main__":
    n = 0
    for deterministic in (True, False):
        for key_blocks, m_blocks, resident in ((1, 1, 1), (2, 3, 1), (3, 5, 2), (4, 6, 4), (5, 5, 3)):
            for seed in range(300):
                run(key_blocks, m_blocks, resident, deterministic, seed)
                n += 1
        for pairs, group, causal in ((3, 2, False), (4, 4, False), (5, 2, True)):
            for seed in range(100):
                run(4, 4, 3, deterministic, seed, pairs=pairs, group=group, causal=causal)
                n += 1
    print("ok", n, "runs")
