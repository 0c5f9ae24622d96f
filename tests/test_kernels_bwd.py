"""Backward kernels (csrc/bwd) against a float32 reference.

Outputs and LSE come from ``hf_flash.reference.fwd`` in float32 so these tests
do not depend on the forward kernel. Rule for every gradient:
``max|ours - ref| <= 3 * max|torch_same_precision - ref| + 1e-5``, where ref is
``reference.bwd`` on float32 copies and torch_same_precision is autograd
through ``naive_attention`` in the input dtype.
"""

import math

import pytest
import torch

from hf_flash import reference
from helpers import capture_graph, cu_seqlens, poison_allocator

pytestmark = pytest.mark.gpu

DIMS = (32, 40, 64, 96, 128, 192, 256, 512)  # 40 runs zero-padded to the d64 kernel
# (sq, sk, h, hk, causal, window, softcap, alibi); covers S = 1, sq != sk, GQA 1/2/8,
# fully masked rows (causal with sq > sk), windows, softcap and ALiBi.
CASES = [
    (1, 1, 4, 4, False, (-1, -1), 0.0, False),
    (1, 130, 4, 2, True, (-1, -1), 0.0, False),
    (113, 203, 8, 1, False, (-1, -1), 0.0, False),
    (256, 256, 4, 4, True, (-1, -1), 0.0, False),
    (300, 129, 4, 2, True, (-1, -1), 0.0, False),
    (200, 333, 8, 2, False, (64, 32), 0.0, False),
    (150, 150, 4, 4, True, (40, 0), 0.0, False),
    (257, 190, 4, 4, False, (-1, -1), 5.0, False),
    (190, 257, 4, 1, True, (-1, -1), 0.0, True),
]


def _inputs(shape_q, shape_k, dtype):
    q = torch.randn(shape_q, device="cuda", dtype=dtype)
    k = torch.randn(shape_k, device="cuda", dtype=dtype)
    v = torch.randn(shape_k, device="cuda", dtype=dtype)
    return q, k, v


def _check(ours, ref, same_precision):
    for name, o, r, s in zip(("dq", "dk", "dv"), ours, ref, same_precision):
        assert torch.isfinite(o).all(), f"{name} has non-finite values"
        err, bound = (o.float() - r).abs().max().item(), 3 * (s.float() - r).abs().max().item() + 1e-5
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def _torch_grads(q, k, v, dout, **kw):
    """Autograd through naive_attention in the inputs' dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    reference.naive_attention(q, k, v, **kw).backward(dout)
    return q.grad, k.grad, v.grad


def _dense_case(b, sq, sk, h, hk, d, dtype, causal, window, softcap, alibi, dropout_p=0.0, deterministic=False):
    q, k, v = _inputs((b, sq, h, d), (b, sk, hk, d), dtype)
    dout = torch.randn_like(q)
    scale = d**-0.5
    slopes = torch.rand(b, h, device="cuda") * 0.3 if alibi else None
    rng = torch.tensor([1234567, 89], dtype=torch.int64, device="cuda") if dropout_p > 0 else None
    f32 = [t.float() for t in (q, k, v)]
    opts = (scale, causal, window[0], window[1], softcap, slopes, dropout_p, rng)
    out32, lse = reference.fwd(*f32, None, None, sq, sk, *opts)
    ref = reference.bwd(dout.float(), *f32, out32, lse, None, None, sq, sk, *opts)
    poison_allocator()  # a dQ block no key block adds into (causal, sq > sk) must still read zero, not the workspace
    ours = torch.ops.hf_flash.bwd(dout, q, k, v, out32.to(dtype), lse, None, None, sq, sk, *opts, deterministic)[:3]
    keep = None
    if dropout_p > 0:
        rows, cols = torch.arange(sq, device="cuda"), torch.arange(sk, device="cuda")
        keep = torch.stack([reference.dropout_keep(rng, i, h, rows, cols, dropout_p) for i in range(b)])
    same = _torch_grads(q, k, v, dout, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                        alibi_slopes=slopes, dropout_keep_mask=keep, dropout_p=dropout_p)
    return ours, ref, same


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"sq{c[0]}-sk{c[1]}-h{c[2]}/{c[3]}")
def test_grads_bf16(d, case):
    sq, sk, h, hk, causal, window, softcap, alibi = case
    _check(*_dense_case(2, sq, sk, h, hk, d, torch.bfloat16, causal, window, softcap, alibi))


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("case", CASES[2:6], ids=lambda c: f"sq{c[0]}-sk{c[1]}-h{c[2]}/{c[3]}")
def test_grads_fp16(d, case):
    sq, sk, h, hk, causal, window, softcap, alibi = case
    _check(*_dense_case(2, sq, sk, h, hk, d, torch.float16, causal, window, softcap, alibi))


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, False)])
def test_grads_dropout(d, causal):
    """Dropout: the backward redraws the forward's Philox mask (same rng_state)."""
    _check(*_dense_case(2, 177, 211, 4, 2, d, torch.bfloat16, causal, (-1, -1), 0.0, False, dropout_p=0.17))


def _check_varlen(lens_q, lens_k, d, h, hk, causal):
    """The varlen backward of these sequences against the float32 reference and per-sequence torch gradients (a
    sequence without queries: zero dK / dV for its keys); returns ours and cu_k."""
    dtype = torch.bfloat16
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q, k, v = _inputs((sum(lens_q), h, d), (sum(lens_k), hk, d), dtype)
    dout = torch.randn_like(q)
    opts = (d**-0.5, causal, -1, -1, 0.0, None, 0.0, None)
    f32 = [t.float() for t in (q, k, v)]
    mq, mk = max(lens_q), max(lens_k)
    out32, lse = reference.fwd(*f32, cu_q, cu_k, mq, mk, *opts)
    ref = reference.bwd(dout.float(), *f32, out32, lse, cu_q, cu_k, mq, mk, *opts)
    poison_allocator()
    ours = torch.ops.hf_flash.bwd(dout, q, k, v, out32.to(dtype), lse, cu_q, cu_k, mq, mk, *opts, False)[:3]
    same = [[], [], []]
    for i in range(len(lens_q)):
        sl_q, sl_k = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lens_q[i] == 0 or lens_k[i] == 0:  # no query sees these keys, or these queries see no key
            same[0].append(torch.zeros_like(q[sl_q]))
            same[1].append(torch.zeros_like(k[sl_k]))
            same[2].append(torch.zeros_like(v[sl_k]))
            continue
        grads = _torch_grads(q[None, sl_q], k[None, sl_k], v[None, sl_k], dout[None, sl_q], causal=causal)
        for acc, g in zip(same, grads):
            acc.append(g[0])
    _check(ours, ref, [torch.cat(g) for g in same])
    return ours, cu_k


@pytest.mark.parametrize("d,causal,hk", [(64, False, 4), (128, True, 2), (96, True, 1), (256, True, 2), (512, True, 2)])
def test_grads_varlen(d, causal, hk):
    lens_q = torch.randint(1, 300, (5,)).tolist()
    _check_varlen(lens_q, [max(1, n + int(torch.randint(-40, 80, ()))) for n in lens_q], d, 4, hk, causal)


@pytest.mark.parametrize("d,causal", [(64, True), (128, False)])
def test_grads_varlen_many_sequences(d, causal):
    """45 sequences of 0-199 rows: the Hopper backward numbers packed key blocks and dQ blocks, finding each one's
    sequence by a binary search over the offsets (flash.h: packed_block_seq), six steps deep here."""
    lens_q = torch.randint(0, 200, (45,)).tolist()
    _check_varlen(lens_q, [n + int(torch.randint(0, 40, ())) for n in lens_q], d, 4, 2, causal)


@pytest.mark.parametrize("d,causal", [(64, False), (128, True)])
def test_grads_varlen_empty_sequences_and_block_edges(d, causal):
    """Sequences of 0, 1, 63, 64, 65, 127, 128, 129 and 300 query rows (the Hopper kernel's query blocks are 64 rows
    at d128 and 128 at d64, and its dQ accumulator starts each sequence on a block of its own), two with keys and no
    queries and one with queries and no keys: every row's gradients against the float32 reference, the empty
    sequences' keys with zero dK / dV and the keyless queries with zero dQ (no key block adds into their dQ blocks,
    which the accumulator then never held)."""
    lens_q = [0, 1, 63, 64, 65, 0, 127, 128, 129, 300]
    lens_k = [n + 17 if n else 5 for n in lens_q]
    lens_k[7] = 0
    ours, cu_k = _check_varlen(lens_q, lens_k, d, 4, 2, causal)
    for i in (0, 5):
        assert not ours[1][int(cu_k[i]):int(cu_k[i + 1])].any() and not ours[2][int(cu_k[i]):int(cu_k[i + 1])].any()
    assert not ours[0][sum(lens_q[:7]):sum(lens_q[:8])].any()


def _bwd_args(b=2, s=2048, h=16, hk=8, d=128, causal=True):
    q, k, v = _inputs((b, s, h, d), (b, s, hk, d), torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = reference.fwd(q, k, v, None, None, s, s, d**-0.5, causal, -1, -1, 0.0, None, 0.0, None)
    return (dout, q, k, v, out, lse, None, None, s, s, d**-0.5, causal, -1, 0 if causal else -1, 0.0, None, 0.0,
            None)


@pytest.mark.parametrize("kernels", ["default", "mma.sync"])
def test_deterministic(kernels, monkeypatch):
    """50 runs, bitwise equal (d sinks too). On the mma.sync kernels (all of them off CC 9.0), 16 key blocks over
    8 dQ copies, so lanes walk 2 blocks each; on CC 9.0 by default, the Hopper kernel's ordered dQ additions."""
    if kernels == "mma.sync":
        monkeypatch.setenv("HF_FLASH_DISABLE_SM90", "1")
    args = _bwd_args()
    sinks = torch.randn(args[1].shape[-2], device="cuda")
    first = torch.ops.hf_flash.bwd(*args, True, sinks)
    assert first[3].shape == sinks.shape and first[3].dtype == torch.float32
    for _ in range(49):
        again = torch.ops.hf_flash.bwd(*args, True, sinks)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    fast = torch.ops.hf_flash.bwd(*args, False, sinks)
    for a, b in zip(first, fast):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("extra", ["none", "sinks", "rel_bias"])
def test_opcheck(extra):
    args = _bwd_args(1, 129, 4, 2, 64)
    tail = {"none": (), "sinks": (torch.randn(4, device="cuda"),),
            "rel_bias": (None, torch.randn(4, 2 * 17 + 1, device="cuda"))}[extra]
    torch.library.opcheck(torch.ops.hf_flash.bwd.default, (*args, False, *tail))


def _forward_built() -> bool:
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    try:
        torch.ops.hf_flash.fwd(q, q, q, None, None, 8, 8, 0.125, False, -1, -1, 0.0, None, 0.0, None, False)
    except RuntimeError:
        return False
    return True


def test_compile_fwd_bwd():
    """torch.compile(fullgraph=True) through flash_attn_func, forward and backward."""
    if not _forward_built():
        pytest.skip("extension built without the forward kernels")
    from hf_flash import flash_attn_func

    q, k, v = (t.requires_grad_() for t in _inputs((2, 200, 4, 64), (2, 200, 2, 64), torch.bfloat16))
    dout = torch.randn_like(q)
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True)
    fn(q, k, v).backward(dout)
    ours = [t.grad for t in (q, k, v)]
    f32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference.naive_attention(*f32, causal=True).backward(dout.float())
    same = _torch_grads(q, k, v, dout, causal=True)
    _check(ours, [t.grad for t in f32], same)


@pytest.mark.parametrize("d", (64, 128))
def test_cuda_graph_fwd_bwd(d):
    """Forward and backward captured in a CUDA graph and replayed on new inputs: the Hopper backward launches its
    main and convert kernels as programmatic dependents (flash.h launch_kernel), which a capture must keep."""
    if not _forward_built():
        pytest.skip("extension built without the forward kernels")
    from hf_flash import flash_attn_func

    q, k, v = (t.requires_grad_() for t in _inputs((2, 700, 4, d), (2, 700, 2, d), torch.bfloat16))
    dout = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        flash_attn_func(q, k, v, causal=True).backward(dout)
        return [t.grad for t in (q, k, v)]

    graph, grads = capture_graph(step)
    for _ in range(2):  # new inputs, same graph
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        torch.testing.assert_close(grads[0], eager[0])  # dQ: fp32 additions in any order, then rounded
        for ours, ref in zip(grads[1:], eager[1:]):  # dK, dV: summed inside one CTA, in one order
            torch.testing.assert_close(ours, ref, atol=0, rtol=0)


# Longer sequences at the head dims of the Hopper kernel (csrc/bwd_sm90, d64/d128/d256/d512, causal or not): several
# key blocks, many query blocks per key block, the GQA head loop, fully masked rows (sq > sk, causal); at d512 the
# two CTAs of a cluster exchange their halves of S^T and dP^T hundreds of times a CTA.
LONG_CASES = [(1000, 1000, 4, 4, True), (517, 1100, 4, 1, False), (1100, 517, 6, 2, True), (64, 2000, 2, 2, True)]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("d", (64, 128, 256, 512))
@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: f"sq{c[0]}-sk{c[1]}-h{c[2]}/{c[3]}-causal{int(c[4])}")
def test_grads_long(d, dtype, case):
    sq, sk, h, hk, causal = case
    _check(*_dense_case(1, sq, sk, h, hk, d, dtype, causal, (-1, -1), 0.0, False))


# Sliding and local windows on the Hopper kernel's head dims: edges inside and across its 128-key / 64-row blocks,
# a window of one key, rows that see no key (sq > sk).
WINDOW_CASES = [(1000, 1000, (200, 0)), (700, 1100, (64, 64)), (1100, 700, (127, 0)), (517, 517, (0, 0)),
                (300, 900, (-1, 100))]


@pytest.mark.parametrize("d", (64, 128, 256, 512))
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"sq{c[0]}-sk{c[1]}-w{c[2][0]}_{c[2][1]}")
def test_grads_long_windows(d, case):
    sq, sk, window = case
    _check(*_dense_case(1, sq, sk, 4, 2, d, torch.bfloat16, False, window, 0.0, False))


# Softcap (Gemma 2) on the Hopper kernel's head dims: a cap of 2 against scores of a few units (tanh far from
# linear, so dS takes its 1 - tanh^2), full, causal with fully masked rows, and a sliding window; deterministic too.
SOFTCAP_CASES = [(1000, 1000, (-1, -1), False), (1100, 517, (-1, 0), False), (700, 1100, (127, 0), True)]


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: f"sq{c[0]}-sk{c[1]}-w{c[2][0]}_{c[2][1]}-det{int(c[3])}")
def test_grads_long_softcap(d, case):
    sq, sk, window, deterministic = case
    causal = window == (-1, 0)
    _check(*_dense_case(1, sq, sk, 4, 2, d, torch.bfloat16, causal, window, 2.0, False,
                        deterministic=deterministic))


@pytest.mark.parametrize("d,hk", [(64, 2), (128, 4)])
def test_backward_allocates_no_zero_gradients(d, hk):
    """The LSE output never gets a gradient, and autograd does not fill one with zeros (a launch per layer and step in
    a host-bound training step); the gradients stay those of the reference."""
    from hf_flash import flash_attn_func

    q, k, v = _inputs((2, 200, 4, d), (2, 200, hk, d), torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(dout)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert not names & {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_"}, sorted(names)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference.naive_attention(qf, kf, vf, causal=True).backward(dout.float())
    for ours, theirs in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        torch.testing.assert_close(ours.float(), theirs, atol=3e-2, rtol=3e-2)


def _bwd_kernel_names(args, deterministic=False):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.ops.hf_flash.bwd(*args, deterministic)
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("d,causal,softcap", [(64, False, 0.0), (128, True, 0.0), (128, False, 30.0), (256, True, 0.0),
                                             (512, True, 0.0)])
def test_sm90_kernel_selected(d, causal, softcap, monkeypatch):
    """On CC 9.0 the wgmma kernel runs the supported cases; HF_FLASH_DISABLE_SM90=1 switches back to csrc/bwd."""
    monkeypatch.delenv("HF_FLASH_DISABLE_SM90", raising=False)  # the mma.sync-only A/B runs set it
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward kernel runs on compute capability 9.0 only")
    args = _bwd_args(1, 300, 4, 2, d, causal)
    args = (*args[:14], softcap, *args[15:])  # the backward's softcap argument
    assert any(f"bwd_sm90::bwd_sm90_kernel<true, {d}," in name for name in _bwd_kernel_names(args))
    monkeypatch.setenv("HF_FLASH_DISABLE_SM90", "1")
    names = _bwd_kernel_names(args)
    mma_sync = "bwd::bwd_large_d_kernel" if d > 128 else "bwd::bwd_kernel"  # csrc/bwd: kernel_large_d.cuh past d128
    assert not any("bwd_sm90" in name for name in names) and any(mma_sync in name for name in names)


def test_d512_softcap_and_deterministic_run_mma_sync(monkeypatch):
    """The d512 Hopper backward is one instance (plain scores, dQ added in any order): softcap and deterministic=True
    run the mma.sync kernel (csrc/bwd.cu: bwd_sm90_supports)."""
    monkeypatch.delenv("HF_FLASH_DISABLE_SM90", raising=False)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward kernel runs on compute capability 9.0 only")
    args = _bwd_args(1, 300, 4, 2, 512, True)
    capped = (*args[:14], 30.0, *args[15:])
    for names in (_bwd_kernel_names(capped), _bwd_kernel_names(args, deterministic=True)):
        assert not any("bwd_sm90" in name for name in names) and any("bwd::bwd_large_d_kernel" in n for n in names)


# (d, window (left, right), sequence lengths (q, k) per batch row, varlen): several key and query blocks, fully
# masked rows (causal with sq > sk), a sliding window, a local window on both sides (the first key block adding
# into a query block is not block 0), GQA 4/2. d64 adds in descending order only in grids of two waves or more (one
# CTA an SM; kernel.cuh): the 4 x 4500 case's 288 CTAs are that on GPUs of up to 144 SMs, the others are under.
DET_SM90_CASES = [(64, (-1, 0), [(1100, 1000), (1100, 1000)], False),
                  (64, (-1, 0), [(4500, 4500)] * 4, False),
                  (128, (-1, -1), [(517, 1100), (517, 1100)], False),
                  (128, (-1, 0), [(1100, 1000), (300, 517), (1, 64)], True),
                  (64, (-1, -1), [(700, 300), (129, 1)], True),
                  (128, (200, 0), [(1000, 1000)], False),
                  (64, (300, 90), [(900, 1300), (1300, 700)], True),
                  (256, (-1, -1), [(517, 1100), (517, 1100)], False),
                  (256, (-1, 0), [(1100, 1000), (300, 517), (1, 64)], True),
                  (256, (300, 90), [(900, 1300), (1300, 700)], True)]


@pytest.mark.parametrize("d,window,lens,varlen", DET_SM90_CASES, ids=lambda c: str(c))
def test_deterministic_sm90(d, window, lens, varlen, monkeypatch):
    """deterministic=True on the Hopper kernel (csrc/bwd_sm90: dQ added in key-block order, a counter per query
    block): it runs there, 20 runs are bitwise equal, and the gradients match the float32 reference."""
    monkeypatch.delenv("HF_FLASH_DISABLE_SM90", raising=False)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward kernel runs on compute capability 9.0 only")
    h, hk, dtype = 4, 2, torch.bfloat16
    lens_q, lens_k = [n for n, _ in lens], [n for _, n in lens]
    mq, mk = max(lens_q), max(lens_k)
    if varlen:
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        q, k, v = _inputs((sum(lens_q), h, d), (sum(lens_k), hk, d), dtype)
    else:
        cu_q = cu_k = None
        q, k, v = _inputs((len(lens), mq, h, d), (len(lens), mk, hk, d), dtype)
    dout = torch.randn_like(q)
    opts = (d**-0.5, window == (-1, 0), *window, 0.0, None, 0.0, None)
    f32 = [t.float() for t in (q, k, v)]
    out32, lse = reference.fwd(*f32, cu_q, cu_k, mq, mk, *opts)
    args = (dout, q, k, v, out32.to(dtype), lse, cu_q, cu_k, mq, mk, *opts)
    assert any(f"bwd_sm90::bwd_sm90_kernel<true, {d}," in n for n in _bwd_kernel_names(args, deterministic=True))
    first = torch.ops.hf_flash.bwd(*args, True)[:3]
    for _ in range(19):
        assert all(torch.equal(a, b) for a, b in zip(first, torch.ops.hf_flash.bwd(*args, True)[:3]))
    ref = reference.bwd(dout.float(), *f32, out32, lse, cu_q, cu_k, mq, mk, *opts)
    default = torch.ops.hf_flash.bwd(*args, False)[:3]  # the same kernel's rounding, added in any order
    for name, o, r, s in zip(("dq", "dk", "dv"), first, ref, default):
        err, bound = (o.float() - r).abs().max().item(), 2 * (s.float() - r).abs().max().item() + 1e-4
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (the default's error, twice)"
