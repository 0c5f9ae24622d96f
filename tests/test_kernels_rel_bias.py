"""T5's relative position bias (``rel_bias`` (H, 2R+1)) on the CUDA kernels against the reference in float32:
forward, LSE and the gradients of q, k, v and the table, dense (the Hopper forward and backward at d64 / d128, the
mma.sync ones with HF_FLASH_DISABLE_SM90=1, with dropout and at the other head dims, zero-padded ones included),
varlen with empty documents, the KV cache (forward only), a strided table; d rel_bias's float32 atomic sums
reproducible within rounding; the Hopper kernels against the mma.sync ones; the refusals (softcap, deterministic training).
Rule: test_kernels_sinks.py's, ``max|ours - ref| <= 3 * max|torch_same_precision - ref| + max(eps, 1e-3) *
max(1, max|ref|)``, ref being ``naive_attention`` in float32 on the inputs (rounded to the input dtype), d
rel_bias's with the backward's rounding of O added (``_ref_grads``), and torch_same_precision ``naive_attention``
in the input dtype."""

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, ops, reference
from hf_flash.reference import naive_attention
from helpers import assert_lse, cu_seqlens, poison_allocator, randn
from test_kernels_fwd_sm90 import forward_kernels, run_sm80
from test_kernels_sinks import _check, _leaves

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16)
NAMES = ("q", "k", "v", "rel_bias")
# (sq, sk, h, hk, d, causal, radius): radii below the lengths (distances clamped), above them, and 1; sq != sk both
# ways, with rows that see no key (causal, sq > sk); GQA and MQA; odd lengths.
CASES = [
    (128, 128, 4, 4, 64, True, 16),  # d64 / d128: the Hopper forward and backward
    (333, 77, 4, 2, 128, True, 512),
    (77, 333, 4, 1, 64, False, 40),
    (300, 300, 8, 2, 128, False, 128),  # T5's radius
    (77, 333, 4, 2, 32, True, 50),  # other head dims: the mma.sync kernels
    (200, 130, 4, 4, 80, True, 300),  # d80 runs zero-padded on the d96 kernels
    (257, 190, 4, 1, 96, False, 1),
    (130, 257, 4, 2, 256, True, 64),  # the backward's large-d kernel
    (100, 100, 2, 1, 512, False, 33),
    (90, 100, 2, 1, 512, True, 20000),  # a radius far past every distance: the op reads the columns in reach
]


def _id(case):
    sq, sk, h, hk, d, causal, radius = case
    return f"sq{sq}-sk{sk}-h{h}/{hk}-d{d}-{'causal' if causal else 'full'}-R{radius}"


def _table(h, radius, dtype=torch.float32):
    return (torch.randn(h, 2 * radius + 1, device="cuda") * 2).to(dtype)


def _ref_grads(ref_in, ref, lse, out, dout):
    """The float32 reference's gradients of q, k, v and the table, the table's with the share of the backward's
    D = rowsum(dO * O) reading O as stored, rounded to the input dtype (flash-attn's design): dS = P (dP - D) is
    off by -P dD, which summed per column is the table's gradient of -dD . LSE. The kernels sum d rel_bias from
    float32 dS over many rows, where this term outgrows the rule's torch term (dq, dk, dv carry it too, within it)."""
    grads = torch.autograd.grad(ref, ref_in, dout.float(), retain_graph=True)
    d_d = (dout.float() * (out.detach().float() - ref.detach())).sum(-1).transpose(1, 2)
    (shift,) = torch.autograd.grad(-(d_d * lse).sum(), ref_in[3])
    return (*grads[:3], grads[3] + shift)


def _dense(sq, sk, h, hk, d, causal, radius, dtype, dropout_p=0.0):
    """Forward, LSE and the gradients of q, k, v and a float32 table (as T5 keeps it under autocast) against the
    reference; with dropout through the op with our own rng_state, so that the reference redraws its mask.
    Returns the leaves, out and dout for more backward passes."""
    low = _leaves(randn(2, sq, h, d, dtype=dtype), randn(2, sk, hk, d, dtype=dtype), randn(2, sk, hk, d, dtype=dtype),
                  _table(h, radius))
    q, k, v, table = low
    kw = {}
    poison_allocator()
    if dropout_p:
        rng = torch.tensor([torch.randint(0, 2**62, ()).item(), torch.randint(0, 2**40, ()).item()],
                           dtype=torch.int64, device="cuda")
        out, lse = ops.run_fwd(q, k, v, None, None, sq, sk, d**-0.5, causal, -1, -1, 0.0, None, dropout_p, rng, False,
                               rel_bias=table)
        rows, cols = torch.arange(sq, device="cuda"), torch.arange(sk, device="cuda")
        keep = torch.stack([reference.dropout_keep(rng, i, h, rows, cols, dropout_p) for i in range(2)])
        kw = dict(dropout_keep_mask=keep, dropout_p=dropout_p)
    else:
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, rel_bias=table, return_attn_probs=True)
    ref_in, same_in = _leaves(*(t.float() for t in low)), _leaves(*low)
    ref, ref_lse = naive_attention(*ref_in[:3], causal=causal, rel_bias=ref_in[3], return_lse=True, **kw)
    same = naive_attention(*same_in[:3], causal=causal, rel_bias=same_in[3], **kw)
    _check("out", out, ref, same)
    with torch.no_grad():  # dropout leaves the LSE alone
        assert_lse(lse, reference.fwd(*ref_in[:3], None, None, sq, sk, d**-0.5, causal, -1, -1, 0.0, None, 0.0, None,
                                      rel_bias=ref_in[3])[1])
    if causal and sq > sk:  # the top rows see no key: zero output
        assert out[:, : sq - sk].eq(0).all()
    dout = randn(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, low, dout, retain_graph=True)
    for name, t, g, g_ref, g_same in zip(NAMES, low, grads, _ref_grads(ref_in, ref, ref_lse, out, dout),
                                         torch.autograd.grad(same, same_in, dout)):
        assert g.dtype == t.dtype
        _check(f"d{name}", g, g_ref, g_same)
    return low, out, dout, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_dense(case, dtype):
    _dense(*case, dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_dense_mma_sync(d, monkeypatch):
    monkeypatch.setenv("HF_FLASH_DISABLE_SM90", "1")  # the head dims of the Hopper kernels, on the mma.sync ones
    _dense(200, 333, 4, 2, d, True, 64, torch.bfloat16)


@pytest.mark.parametrize("d,causal", [(64, False), (128, True)])
def test_dense_dropout(d, causal):
    """Dropout runs the mma.sync kernels; the backward redraws the forward's Philox mask."""
    _dense(177, 211, 4, 2, d, causal, 32, torch.bfloat16, dropout_p=0.17)


@pytest.mark.parametrize("d,sm90", [(64, True), (64, False), (256, False)], ids=["d64", "d64-mma-sync", "d256"])
def test_drel_bias_reproducible(d, sm90, monkeypatch):
    """d rel_bias is summed with float32 atomics (per CTA in shared memory, flushed per query head into the
    table): runs differ by the order of the sums only, where a lost or doubled update would not. Many key blocks,
    query blocks and GQA heads per CTA; each backward kernel (Hopper on CC 9.0, mma.sync, large-d)."""
    if not sm90:
        monkeypatch.setenv("HF_FLASH_DISABLE_SM90", "1")
    low, out, dout, first = _dense(1024, 1024, 8, 2, d, True, 128, torch.bfloat16)
    for _ in range(4):
        again = torch.autograd.grad(out, low, dout, retain_graph=True)
        for name, a, b in zip(NAMES, first, again):  # dq, d rel_bias: float32 sums, rounded (dq) to bf16
            tol = 2**-7 if name == "q" else 1e-4
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item(), msg=f"d{name} moved")


@pytest.mark.parametrize("d,causal", [(64, True), (128, False)])
def test_varlen(d, causal):
    """Positions count within each document; empty documents (no queries: their keys get no gradient; no keys:
    zero output). The table in q's dtype, as a bf16 model holds it."""
    dtype, h, hk, radius = torch.bfloat16, 8, 2, 48
    lens_q, lens_k = [37, 0, 129, 64, 5, 300], [37, 5, 129, 200, 0, 260]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    low = _leaves(randn(sum(lens_q), h, d, dtype=dtype), randn(sum(lens_k), hk, d, dtype=dtype),
                  randn(sum(lens_k), hk, d, dtype=dtype), _table(h, radius, dtype))
    poison_allocator()
    out, lse, _ = flash_attn_varlen_func(*low[:3], cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                         rel_bias=low[3], return_attn_probs=True)
    f32 = [t.detach().float() for t in low]
    assert_lse(lse, reference.fwd(*f32[:3], cu_q, cu_k, max(lens_q), max(lens_k), d**-0.5, causal, -1, -1, 0.0,
                                  None, 0.0, None, rel_bias=f32[3])[1])
    dout = randn(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, low, dout)
    assert grads[3].dtype == dtype
    d_ref, d_same = torch.zeros_like(f32[3]), torch.zeros_like(f32[3])
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens_q)):
        qs, ks = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        if not lens_q[i] or not lens_k[i]:
            assert out[qs].eq(0).all() and grads[0][qs].eq(0).all()
            assert grads[1][ks].eq(0).all() and grads[2][ks].eq(0).all()
            continue
        ref_in = _leaves(f32[0][None, qs], f32[1][None, ks], f32[2][None, ks], f32[3])
        same_in = _leaves(low[0][None, qs], low[1][None, ks], low[2][None, ks], low[3])
        ref, ref_lse = naive_attention(*ref_in[:3], causal=causal, rel_bias=ref_in[3], return_lse=True)
        same = naive_attention(*same_in[:3], causal=causal, rel_bias=same_in[3])
        _check(f"out[{i}]", out[qs], ref[0], same[0])
        g_ref = _ref_grads(ref_in, ref, ref_lse, out[None, qs], dout[None, qs])
        g_same = torch.autograd.grad(same, same_in, dout[None, qs])
        for name, g, gr, gs, rows in zip("qkv", grads, g_ref, g_same, (qs, ks, ks)):
            _check(f"d{name}[{i}]", g[rows], gr[0], gs[0])
        d_ref += g_ref[3]
        d_same += g_same[3].float()
    _check("drel_bias", grads[3], d_ref, d_same)


@pytest.mark.parametrize("sq,d", [(1, 64), (4, 128), (40, 64)])  # 40 queries: the forward kernel's KV-cache path
def test_kvcache(sq, d):
    """Keys are each row's valid cache rows [cache_leftpad, end): a full row, an empty one, one with fewer keys
    than queries (causal: rows that see none), a left-padded one. GQA 4; no gradient."""
    dtype, b, s_cache, h, hk, radius = torch.bfloat16, 4, 1000, 8, 2, 32
    k_cache, v_cache = randn(b, s_cache, hk, d, dtype=dtype), randn(b, s_cache, hk, d, dtype=dtype)
    q, table = randn(b, sq, h, d, dtype=dtype), _table(h, radius)
    ends, starts = [1000, 0, 2, 517], [0, 0, 0, 300]
    seqlens = torch.tensor(ends, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor(starts, dtype=torch.int32, device="cuda")
    poison_allocator()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                       causal=True, rel_bias=table, return_softmax_lse=True)
    for i, (s, e) in enumerate(zip(starts, ends)):
        if s == e:
            assert out[i].eq(0).all()
            continue
        args = (q[i:i + 1], k_cache[i:i + 1, s:e], v_cache[i:i + 1, s:e])
        ref = naive_attention(*(t.float() for t in args), causal=True, rel_bias=table)
        same = naive_attention(*args, causal=True, rel_bias=table)
        _check(f"row {i} (keys {s}..{e})", out[i:i + 1], ref, same)
    _, lse_ref = reference.fwd_kvcache(q.float(), k_cache.float(), v_cache.float(), seqlens, leftpad, d**-0.5, True,
                                       -1, -1, 0.0, None, 0, rel_bias=table)
    assert_lse(lse, lse_ref)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels run on compute capability 9.0")
@pytest.mark.parametrize("d,causal", [(64, False), (128, True)])
def test_sm90_matches_mma_sync(monkeypatch, d, causal):
    """With a table the Hopper kernels run (forward and backward, d64 / d128) and agree with the mma.sync ones
    within rounding: the forwards on the same inputs, the backwards on the same forward output."""
    low = _leaves(randn(2, 333, 4, d, dtype=torch.bfloat16), randn(2, 517, 2, d, dtype=torch.bfloat16),
                  randn(2, 517, 2, d, dtype=torch.bfloat16), _table(4, 100))
    fwd = lambda: flash_attn_func(*low[:3], causal=causal, rel_bias=low[3], return_attn_probs=True)[:2]  # noqa: E731
    assert any("fwd_sm90_kernel" in n for n in forward_kernels(fwd))
    assert not any("fwd_sm90_kernel" in n for n in run_sm80(monkeypatch, lambda: forward_kernels(fwd)))
    (out, lse), (out80, lse80) = fwd(), run_sm80(monkeypatch, fwd)
    assert torch.equal(lse.isposinf(), lse80.isposinf())
    torch.testing.assert_close(lse, lse80, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out.float(), out80.float(), atol=2e-2, rtol=2**-7)  # a bf16 rounding apart
    dout = torch.randn_like(out)
    bwd = lambda: torch.autograd.grad(out, low, dout, retain_graph=True)  # noqa: E731
    assert any("bwd_sm90" in n for n in forward_kernels(bwd))
    assert not any("bwd_sm90" in n for n in run_sm80(monkeypatch, lambda: forward_kernels(bwd)))
    for name, a, b in zip(NAMES, bwd(), run_sm80(monkeypatch, bwd)):  # bf16 roundings (dq, dk, dv), float32 sums
        tol = 1e-3 if name == "rel_bias" else 2**-6
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * a.abs().max().item(), msg=f"d{name}")


def test_softcap_is_refused():
    q, table = randn(1, 64, 4, 64, dtype=torch.bfloat16), _table(4, 8)
    cache_len = torch.full((1,), 64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(q, q, q, softcap=5.0, rel_bias=table)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_with_kvcache(q[:, :1], q, q, cache_seqlens=cache_len, softcap=5.0, rel_bias=table)
    with pytest.raises(ValueError, match="softcap"):  # the op checks it too
        torch.ops.hf_flash.fwd(q, q, q, None, None, 64, 64, 0.125, False, -1, -1, 5.0, None, 0.0, None, False, None,
                               table)


def test_deterministic_training_is_refused():
    """d rel_bias's sums use atomics: deterministic=True is refused where a gradient may be taken, by the public
    function and by the backward op; inference is fine."""
    q, table = randn(1, 64, 4, 64, dtype=torch.bfloat16), _table(4, 8).requires_grad_()
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="deterministic"):
        flash_attn_func(q, q, q, deterministic=True, rel_bias=table)
    with pytest.raises(ValueError, match="deterministic"):
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 64, 64, deterministic=True, rel_bias=table)
    with torch.no_grad():
        out, lse, _ = flash_attn_func(q, q, q, deterministic=True, rel_bias=table, return_attn_probs=True)
    with pytest.raises(ValueError, match="deterministic"):
        torch.ops.hf_flash.bwd(q, q, q, q, out, lse, None, None, 64, 64, 0.125, False, -1, -1, 0.0, None, 0.0, None,
                               True, None, table)


def test_radius_beyond_shared_memory():
    """The backward keeps d rel_bias's sums of the columns in reach in shared memory; where they do not fit next to
    the d512 tiles (4097 keys: 32 KB more), the kernel adds into global memory instead: same results."""
    _dense(4097, 4097, 1, 1, 512, True, 5000, torch.bfloat16)


@pytest.mark.parametrize("d", (64, 128))
def test_strided_table(d):
    """A table viewed with strides (T5's compute_bias leaves (H, 2R + 1) as a transposed view of (2R + 1, H)) is read
    in place, as its contiguous copy: the same output, and its gradient within the float32 sums' rounding."""
    q, k, v = (randn(2, 150, 4, d, dtype=torch.bfloat16) for _ in range(3))
    rows = torch.randn(2 * 40 + 1, 4, device="cuda", requires_grad=True)
    dense = rows.detach().t().contiguous().requires_grad_()
    out = flash_attn_func(q, k, v, causal=True, rel_bias=rows.t())
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True, rel_bias=dense))
    dout = randn(*out.shape, dtype=torch.bfloat16)
    (grad,) = torch.autograd.grad(out, rows, dout)
    (grad_dense,) = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, rel_bias=dense), dense, dout)
    torch.testing.assert_close(grad.t(), grad_dense, rtol=1e-5, atol=1e-5 * grad_dense.abs().max().item())
