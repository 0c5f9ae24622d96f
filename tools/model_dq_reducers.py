"""Random-interleaving model of the Hopper backward's dQ hand-off for whole blocks (d64 / d128,
csrc/bwd_sm90/kernel.cuh): in each CTA (a key block) the consumers write fill f into the one dQ slot once fill
f - 1 has been read, and arrive on barrier pair f % 2; deterministic mode's two reducer lanes take the fills in
turn (the default: one lane takes all), each waiting for its fill's dq_full, then (deterministic) for the counter
of its query block to say that every key block before it in the order has added, reading the slot into an
asynchronous reduction, freeing the slot (dq_empty), waiting for its reduction to complete and releasing the
counter. The default mode claims (the first add into a block stores it, nothing zeroes the accumulator): before its
fill is ready the reducer claims the block's counter (0 -> 1) or waits until it says stored (2); a claimed fill goes
to the CTA's storer lane through a one-entry mailbox (claim_full / claim_empty), which stores it, frees the slot,
waits for its store to complete and marks the counter 2. CTAs start in grid order, at most `resident` at a time;
reductions and stores complete late and out of order. The grid
holds `pairs` (kv head, batch) pairs of `key_blocks` each, in sections of `group` pairs with the block index
slowest (csrc/sm90/schedule.cuh's section_tile, mirrored below). Fails on a deadlock, a slot read before its fill
was written or after it was overwritten, or (deterministic) a query block's additions landing out of the key
blocks' order, or (default) an add landing before its block's store or a block stored twice. `mutation` drops one
rule (MUTATIONS), to show the model catches its absence (tests/test_tools.py). Causal: key block n sees query blocks
n .. m_blocks - 1; full attention: all. Deterministic mode walks them last first (d128's order); the default from
the key block's diagonal (query block n) up, wrapping (kernel.cuh: QueryWalk).
  python3 tools/model_dq_reducers.py"""
import random


class MBar:  # arrival count 1 a phase (the consumers' 256 arrivals, or the reducer's one, as one)
    def __init__(s): s.phase = 0
    def arrive(s): s.phase += 1
    def done(s, parity): return (s.phase & 1) != parity  # try_wait.parity


# The rules a mutation drops: the two barrier pairs (both reducers on pair 0, waiting with fill & 1 as one reducer
# does); the consumers' wait for fill f - 1's read; the reducer's wait for its reduction to complete before it
# releases the counter; the grid starting a pair's key blocks in the order's (blocks_reversed: last first); the
# storer's wait for its store to complete before it marks the block stored (stored_before_complete, default mode).
MUTATIONS = ("one_barrier_pair", "no_empty_wait", "release_before_complete", "blocks_reversed",
             "stored_before_complete")
CLAIM_MUTATIONS = ("stored_before_complete",)  # rules of the default mode's claims


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
    stores = {pm: [] for pm in counters}  # default mode: the key blocks whose stores into (pair, m) completed
    inflight = []  # (cta, reducer or 's' for the storer, query block)
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

    def read_slot(c, f, who, m):  # an asynchronous reduction (or store) of fill f, issued
        assert c['slot'] == [f, False], f"tile {c['tile']}: {who} read {c['slot']} for fill {f}"
        c['slot'][1] = True
        inflight.append((c['index'], who, m))
        c['pending'][who] += 1

    def storer(i):  # default mode: the blocks the reducer claimed, through the mailbox
        c = ctas[i]
        p, _ = c['tile']
        k = 0
        while True:
            while not c['claim_full'].done(k & 1): yield
            if c['box'] is None:
                return
            f, m = c['box']
            read_slot(c, f, 's', m)
            yield
            c['empty'][pair(f)].arrive()
            if mutation != "stored_before_complete":
                while c['pending']['s']: yield
            counters[(p, m)] = 2
            c['claim_empty'].arrive()
            k += 1

    def reducer(i, r):
        c = ctas[i]
        p, n = c['tile']
        handed = 0
        for f, m in enumerate(c['walk']):
            if f % reducers != r:
                continue
            mine = False
            if not deterministic:  # claim before the fill is ready (one compare-and-swap), or wait for the store
                mine = counters[(p, m)] == 0
                if mine:
                    counters[(p, m)] = 1
                while not mine and counters[(p, m)] != 2: yield
                yield
            while not c['full'][pair(f)].done(parity(f)): yield
            if deterministic:
                while counters[(p, m)] != n: yield  # ascending order: the pair's key blocks 0 .. n - 1 added into m
            if mine:  # the storer's, once it has taken the mailbox's last block
                if handed:
                    while not c['claim_empty'].done((handed - 1) & 1): yield
                c['box'] = (f, m)
                c['claim_full'].arrive()
                handed += 1
                continue
            read_slot(c, f, r, m)
            yield
            c['empty'][pair(f)].arrive()
            if deterministic:
                if mutation != "release_before_complete":
                    while c['pending'][r]: yield
                counters[(p, m)] += 1
        if not deterministic:  # the end mark
            if handed:
                while not c['claim_empty'].done((handed - 1) & 1): yield
            c['box'] = None
            c['claim_full'].arrive()
        while c['pending'][r]: yield

    progs, started = {}, 0
    steps = 0
    while started < len(tiles) or progs or inflight:
        steps += 1
        assert steps <= 400000, f"deadlock: {started} of {len(tiles)} tiles started"
        if started < len(tiles) and len({k[0] for k in progs}) < resident:
            i, (p, n) = started, tiles[started]
            started += 1
            seen = list(range(n if causal else 0, m_blocks))
            if deterministic:
                walk = seen[::-1]
            else:
                start = seen.index(min(n, m_blocks - 1)) if seen else 0
                walk = seen[start:] + seen[:start]
            ctas[i] = dict(index=i, tile=(p, n), walk=walk, slot=None, pending={0: 0, 1: 0, 's': 0},
                           full=[MBar(), MBar()], empty=[MBar(), MBar()], claim_full=MBar(), claim_empty=MBar(),
                           box=None)
            progs[(i, 'c')] = consumers(i)
            for r in range(reducers):
                progs[(i, r)] = reducer(i, r)
            if not deterministic:
                progs[(i, 's')] = storer(i)
            continue
        choices = list(progs) + (['done'] if inflight else [])
        ch = rng.choice(choices)
        if ch == 'done':
            i, r, m = inflight.pop(rng.randrange(len(inflight)))
            p, n = ctas[i]['tile']
            if r == 's':
                stores[(p, m)].append(n)
            else:
                assert deterministic or stores[(p, m)], f"pair {p}, query block {m}: an add landed before the store"
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
        else:
            assert len(stores[(p, m)]) == (1 if order else 0), f"pair {p}, query block {m}: stored {stores[(p, m)]}"
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
