"""Random-interleaving model of the cluster backward's S^T / dP^T exchange (csrc/bwd_sm90/kernel.cuh, `exchange`):
two CTAs of a cluster, two consumer warpgroups each, meeting at a named barrier every step; pushes (st.async)
delivered late and out of order; mbarrier phases, transaction counts and parity waits as PTX defines them.
shared (d512): both warpgroups hold the same partial, warpgroup k % 2 pushes exchange k into one buffer that both
read; else (d256, exp/bwd-d256-cluster) each warpgroup pushes its own partial into the peer's same warpgroup's
buffer. Fails on a deadlock, a buffer overwritten before all its reader warps read it, bytes landing before the
arming, or a remote access to an exited CTA. `mutation` drops one rule of the protocol (MUTATIONS), to show the
model catches its absence (tests/test_tools.py).
  python3 tools/model_cluster_exchange.py"""
import random


class MBar:
    def __init__(s, count): s.count, s.pending, s.tx, s.phase = count, count, 0, 0
    def _check(s):
        if s.pending == 0 and s.tx == 0:
            s.phase += 1
            s.pending = s.count
    def arrive(s, n=1, tx=0):
        s.tx += tx
        s.pending -= n
        assert s.pending >= 0, "too many arrivals"
        s._check()
    def complete_tx(s, b):
        s.tx -= b
        assert s.tx >= 0, "bytes before the arming"
        s._check()
    def done(s, parity): return (s.phase & 1) != parity  # try_wait.parity


# The protocol's rules a mutation drops: the sender's wait for its buffer's x_empty before a push; the wait at exit
# for the peer's reads of the last push; arming x_full for the next exchange before freeing the buffer (moved after).
MUTATIONS = ("no_empty_wait", "no_exit_wait", "arm_after_free")


def run(iters, seed, shared, mutation=None):
    assert mutation in (None, *MUTATIONS), mutation
    rng, nbytes = random.Random(seed), 16384
    nbuf, readers = (1, 8) if shared else (2, 4)  # buffers a CTA; warps reading each
    cta = []
    for _ in range(2):
        c = dict(x_full=[MBar(1) for _ in range(nbuf)], x_empty=[MBar(readers) for _ in range(nbuf)],
                 X=[None] * nbuf, reads=[{} for _ in range(nbuf)], exited=False, done=[False, False], bar={})
        for b in c['x_full']: b.arrive(1, nbytes)  # armed for exchange 0 at init
        cta.append(c)
    inflight = []  # (dst cta, buffer, k, src cta)

    def wg_prog(c, w):
        me, peer = cta[c], cta[c ^ 1]
        xb = 0 if shared else w
        for it in range(iters):
            for k in (2 * it, 2 * it + 1):
                if not shared or w == k % 2:
                    if k > 0 and mutation != "no_empty_wait":
                        while not me['x_empty'][xb].done((k - 1) & 1): yield
                    assert not peer['exited'], "st.async into an exited CTA"
                    inflight.append((c ^ 1, xb, k, c))
                while not me['x_full'][xb].done(k & 1): yield
                arming = w == 0 or not shared  # the arming thread: tid 0, or each warpgroup's first
                if arming and mutation != "arm_after_free":
                    me['x_full'][xb].arrive(1, nbytes)
                assert me['X'][xb] == (k, c ^ 1), (c, w, k, me['X'][xb])
                me['reads'][xb][k] = me['reads'][xb].get(k, 0) + 4
                yield
                assert not peer['exited'], "remote arrive on an exited CTA"
                peer['x_empty'][xb].arrive(4)
                if arming and mutation == "arm_after_free":
                    yield
                    me['x_full'][xb].arrive(1, nbytes)
            me['bar'][it] = me['bar'].get(it, 0) + 1  # the dS^T barrier of the two warpgroups
            while me['bar'][it] < 2: yield
        if (not shared or w == 1) and iters > 0 and mutation != "no_exit_wait":
            while not me['x_empty'][xb].done((2 * iters - 1) & 1): yield
        me['done'][w] = True
        me['exited'] = all(me['done'])

    progs = {(c, w): wg_prog(c, w) for c in range(2) for w in range(2)}
    steps = 0
    while progs or inflight:
        steps += 1
        if steps > 200000:
            raise RuntimeError("deadlock")
        choices = list(progs) + (['msg'] if inflight else [])
        ch = rng.choice(choices)
        if ch == 'msg':
            dst, xb, k, src = inflight.pop(rng.randrange(len(inflight)) if rng.random() < 0.3 else 0)
            d = cta[dst]
            assert not d['exited'], "st.async into an exited CTA"
            if d['X'][xb] is not None:
                pk = d['X'][xb][0]
                assert d['reads'][xb].get(pk, 0) == readers, f"buffer overwritten before its readers read push {pk}"
            d['X'][xb] = (k, src)
            d['x_full'][xb].complete_tx(nbytes)
        else:
            try:
                next(progs[ch])
            except StopIteration:
                del progs[ch]


if __name__ == "__main__":
    n = 0
    for shared in (True, False):
        for iters in (0, 1, 2, 3, 5, 8):
            for seed in range(400):
                run(iters, seed, shared)
                n += 1
    print("ok", n, "runs")
