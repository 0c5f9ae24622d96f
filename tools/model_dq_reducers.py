"""Random-interleaving model of the Hopper backward's dQ hand-off for whole blocks (d64 / d128,
csrc/bwd_sm90/kernel.cuh): in each CTA (a key block) the consumers write fill f into the one dQ slot once fill
f - 1 has been read, and arrive on barrier pair f % 2; deterministic mode's two reducer lanes take the fills in
turn (the default: one lane takes all), each waiting for its fill's dq_full, then (deterministic) for the counter
of its query block to say that every key block before it in the order has added, reading the slot into an
asynchronous reduction, freeing the slot (dq_empty), waiting for its reduction to complete and releasing the
counter. CTAs start in grid order, at most `resident` at a time; reductions complete late and out of order. Fails
on a deadlock, a slot read before its fill was written or after it was overwritten, or (deterministic) a query
block's additions landing out of the key blocks' order. `mutation` drops one rule (MUTATIONS), to show the model
catches its absence (tests/test_tools.py). Each key block n walks query blocks n .. m_blocks - 1, last first
(d128's causal walk).
  python3 tools/model_dq_reducers.py"""
import random


class MBar:  # arrival count 1 a phase (the consumers' 256 arrivals, or the reducer's one, as one)
    def __init__(s): s.phase = 0
    def arrive(s): s.phase += 1
    def done(s, parity): return (s.phase & 1) != parity  # try_wait.parity


# The rules a mutation drops: the two barrier pairs (both reducers on pair 0, waiting with fill & 1 as one reducer
# does); the consumers' wait for fill f - 1's read; the reducer's wait for its reduction to complete before it
# releases the counter.
MUTATIONS = ("one_barrier_pair", "no_empty_wait", "release_before_complete")


def run(key_blocks, m_blocks, resident, deterministic, seed, mutation=None):
    assert mutation in (None, *MUTATIONS), mutation
    rng = random.Random(seed)
    reducers = 2 if deterministic else 1
    counters = [0] * m_blocks
    landed = [[] for _ in range(m_blocks)]  # key blocks whose additions into m completed, in order
    inflight = []  # (cta, m, key block)
    ctas = {}

    def pair(f):
        return 0 if mutation == "one_barrier_pair" else f % 2

    def parity(f):
        return f & 1 if mutation == "one_barrier_pair" else (f // 2) & 1

    def consumers(n):
        c = ctas[n]
        for f, m in enumerate(c['walk']):
            if f >= 1 and mutation != "no_empty_wait":
                while not c['empty'][pair(f - 1)].done(parity(f - 1)): yield
            assert c['slot'] is None or c['slot'][1], f"key block {n}: fill {c['slot'][0]} overwritten before its read"
            c['slot'] = [f, False]
            yield
            c['full'][pair(f)].arrive()

    def reducer(n, r):
        c = ctas[n]
        for f, m in enumerate(c['walk']):
            if f % reducers != r:
                continue
            while not c['full'][pair(f)].done(parity(f)): yield
            if deterministic:
                while counters[m] != n: yield  # ascending order: key blocks 0 .. n - 1 added into m
            assert c['slot'] == [f, False], f"key block {n}: reducer {r} read {c['slot']} for fill {f}"
            c['slot'][1] = True
            inflight.append((n, r, m))
            c['pending'][r] += 1
            yield
            c['empty'][pair(f)].arrive()
            if deterministic:
                if mutation != "release_before_complete":
                    while c['pending'][r]: yield
                counters[m] += 1
        while c['pending'][r]: yield

    progs, started = {}, 0
    steps = 0
    while started < key_blocks or progs or inflight:
        steps += 1
        if steps > 400000:
            raise RuntimeError("deadlock")
        if started < key_blocks and len({k[0] for k in progs}) < resident:
            n = started
            started += 1
            ctas[n] = dict(walk=list(range(m_blocks - 1, n - 1, -1)), slot=None, pending=[0, 0],
                           full=[MBar(), MBar()], empty=[MBar(), MBar()])
            progs[(n, 'c')] = consumers(n)
            for r in range(reducers):
                progs[(n, r)] = reducer(n, r)
            continue
        choices = list(progs) + (['done'] if inflight else [])
        ch = rng.choice(choices)
        if ch == 'done':
            n, r, m = inflight.pop(rng.randrange(len(inflight)))
            landed[m].append(n)
            ctas[n]['pending'][r] -= 1
        else:
            try:
                next(progs[ch])
            except StopIteration:
                del progs[ch]
    if deterministic:
        for m in range(m_blocks):
            assert landed[m] == sorted(landed[m]), f"query block {m}: additions landed in order {landed[m]}"
    for m in range(m_blocks):
        assert sorted(landed[m]) == list(range(min(m, key_blocks - 1) + 1)), f"query block {m}: {landed[m]}"


if __name__ == "__main__":
    n = 0
    for deterministic in (True, False):
        for key_blocks, m_blocks, resident in ((1, 1, 1), (2, 3, 1), (3, 5, 2), (4, 6, 4), (5, 5, 3)):
            for seed in range(300):
                run(key_blocks, m_blocks, resident, deterministic, seed)
                n += 1
    print("ok", n, "runs")
