"""The PyTorch reference (the CPU path and the kernels' twin) against textbook
float64 attention: forward, LSE and all gradients, on a randomized grid."""

import math

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, reference
from hf_flash.reference import naive_attention
from helpers import cu_seqlens

F64 = torch.float64


def rand(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    err = (actual - expected).abs().max().item()
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"


# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, softcap)
GRID = [
    (2, 17, 17, 4, 4, 32, False, (-1, -1), 0.0),
    (1, 1, 1, 2, 1, 64, True, (-1, -1), 0.0),
    (2, 1, 300, 8, 1, 40, True, (-1, -1), 0.0),  # decode-like, MQA, odd head dim
    (1, 113, 203, 8, 4, 80, True, (-1, -1), 0.0),  # sq < sk: bottom-right causal
    (2, 203, 113, 4, 2, 96, True, (-1, -1), 0.0),  # sq > sk: top rows fully masked
    (1, 257, 257, 8, 1, 128, False, (31, 7), 0.0),  # asymmetric local window
    (1, 129, 129, 2, 2, 256, True, (16, 0), 50.0),  # sliding window + softcap
    (1, 64, 64, 8, 8, 192, False, (-1, -1), 30.0),
    (1, 1030, 1030, 2, 1, 32, True, (-1, -1), 0.0),  # several K/V tiles
    (3, 33, 65, 4, 2, 59, False, (5, 5), 0.0),  # symmetric window (ModernBERT-style), odd d
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window,softcap", GRID)
def test_matches_naive_float64(b, sq, sk, h, hk, d, causal, window, softcap):
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    ref = naive_attention(q, k, v, **opts)
    assert_close(out, ref, 1e-10, "out")
    dout = torch.randn_like(out)
    for name, g, g_ref in zip("qkv", grads(out, (q, k, v), dout), grads(ref, (q, k, v), dout)):
        # LSE is stored in float32 (as the kernels do), so gradients are float32-accurate.
        assert_close(g, g_ref, 2e-5 * max(1.0, g_ref.abs().max().item()), f"d{name}")
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)


def test_lse_is_logsumexp_and_inf_on_empty_rows():
    b, sq, sk, h, d = 2, 40, 24, 4, 32
    q, k, v = (torch.randn(b, s, h, d, dtype=F64) for s in (sq, sk, sk))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    rows = torch.arange(sq)[:, None] + sk - sq
    s = s.masked_fill(torch.arange(sk)[None, :] > rows, -math.inf)
    expected = torch.logsumexp(s, -1)
    empty = torch.isinf(expected)
    assert empty.any(), "case must contain fully masked rows"
    assert torch.isposinf(lse[empty]).all(), "empty rows must have LSE = +inf (gradients then vanish)"
    assert_close(lse[~empty].double(), expected[~empty], 1e-5, "lse")
    empty_rows = empty[0, 0]
    assert (out[:, empty_rows] == 0).all(), "fully masked rows must output exactly 0"


def test_fully_masked_rows_give_zero_gradients():
    q, k, v = rand(1, 30, 2, 16), rand(1, 10, 2, 16), rand(1, 10, 2, 16)
    out = flash_attn_func(q, k, v, causal=True)  # rows 0..19 see no key
    dq, dk, dv = grads(out, (q, k, v), torch.randn_like(out))
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert (dq[:, :20] == 0).all()


@pytest.mark.parametrize("hk", [1, 2, 8])
def test_alibi(hk):
    b, s, h, d = 2, 50, 8, 32
    q, k, v = rand(b, s, h, d), rand(b, s, hk, d), rand(b, s, hk, d)
    slopes = torch.rand(b, h, dtype=torch.float32)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    ref = naive_attention(q, k, v, causal=True, alibi_slopes=slopes.double())
    assert_close(out, ref, 1e-6, "out")  # slopes are float32 by API


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_error_within_twice_torch(dtype):
    """flash-attn's rule: error vs a float64 oracle at most 2x that of naive attention in `dtype`."""
    q, k, v = (torch.randn(2, 97, 4, 64, dtype=dtype) for _ in range(3))
    ref = naive_attention(*(t.double() for t in (q, k, v)), causal=True)
    same_precision = naive_attention(q.float(), k.float(), v.float(), causal=True).to(dtype)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == dtype
    bound = 2 * (same_precision.double() - ref).abs().max().item() + 1e-5
    assert_close(out.double(), ref, bound, f"out {dtype}")


def _random_cu_seqlens(batch, max_len, allow_empty=True):
    lengths = torch.randint(0 if allow_empty else 1, max_len + 1, (batch,))
    return torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]), lengths


@pytest.mark.parametrize("causal,window,hk", [(True, (-1, -1), 2), (False, (-1, -1), 4), (True, (8, 0), 1)])
def test_varlen_matches_per_sequence(causal, window, hk):
    batch, h, d = 5, 4, 48
    cu_q, len_q = _random_cu_seqlens(batch, 70)
    cu_k, len_k = _random_cu_seqlens(batch, 90)
    q = rand(int(cu_q[-1]), h, d)
    k, v = rand(int(cu_k[-1]), hk, d), rand(int(cu_k[-1]), hk, d)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(len_q.max()), int(len_k.max()), causal=causal,
                                 window_size=window)
    dout = torch.randn_like(out)
    dq, dk, dv = grads(out, (q, k, v), dout)
    for i in range(batch):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if qs.stop == qs.start:
            continue
        args = [t[None].detach().requires_grad_() for t in (q[qs], k[ks], v[ks])]
        ref = naive_attention(*args, causal=causal, window_size=window)
        assert_close(out[qs], ref[0], 1e-10, f"out[seq {i}]")
        g_ref = grads(ref, args, dout[qs][None])
        for name, g, gr, sl in zip("qkv", (dq, dk, dv), g_ref, (qs, ks, ks)):
            scale = gr.abs().max().item() if gr.numel() else 1.0  # a sequence may have no keys (empty dk/dv)
            assert_close(g[sl], gr[0], 2e-5 * max(1.0, scale), f"d{name}[seq {i}]")


@pytest.mark.gpu
def test_varlen_memory_follows_the_sequences_not_the_longest():
    """float32 runs the reference path on a GPU too: one long query sequence against one long key sequence,
    with short partners, must cost their own Sq * Sk, not 2 * max Sq * max Sk (padded: ~4 GiB of scores a
    tensor here, against ~1 MiB)."""
    h, d, n = 16, 64, 4000
    lens_q, lens_k = [n, 1, 3], [1, n, 2]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = torch.randn(sum(lens_q), h, d, device="cuda", requires_grad=True)
    k, v = (torch.randn(sum(lens_k), h, d, device="cuda", requires_grad=True) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, n, n, causal=True, dropout_p=0.1)
    out.sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 256 << 20, f"peak {peak / 2**20:.0f} MiB for {n + n + 6} score elements per head"
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_dropout_mask_is_reproducible_and_exact():
    b, sq, sk, h, hk, d, p = 2, 37, 70, 4, 2, 16, 0.3
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    rng = torch.randint(0, 2**62, (2,))
    args = (None, None, sq, sk, 0.25, True, -1, -1, 0.0, None, p, rng)
    out, lse = reference.fwd(q, k, v, *args)
    keep = torch.stack([reference.dropout_keep(rng, i, h, torch.arange(sq), torch.arange(sk), p) for i in range(b)])
    assert abs(keep.double().mean().item() - (1 - p)) < 0.02
    ref = naive_attention(q, k, v, softmax_scale=0.25, causal=True, dropout_keep_mask=keep, dropout_p=p)
    assert_close(out, ref, 1e-10, "dropout out")
    dout = torch.randn_like(out)
    ours = reference.bwd(dout, q, k, v, out, lse, None, None, sq, sk, 0.25, True, -1, -1, 0.0, None, p, rng)
    autograd = grads(out, (q, k, v), dout)  # the reference path: autograd sees the forward's mask
    for name, g, ga, gr in zip("qkv", ours, autograd, grads(ref, (q, k, v), dout)):
        assert_close(g, gr, 2e-5 * max(1.0, gr.abs().max().item()), f"dropout d{name}")
        assert_close(ga, gr, 1e-10 * max(1.0, gr.abs().max().item()), f"dropout d{name} (autograd)")
    other = reference.dropout_keep(rng + torch.tensor([0, 1]), 0, h, torch.arange(sq), torch.arange(sk), p)
    assert not torch.equal(other, keep[0]), "a new offset must draw a new mask"


def test_dropout_through_api_uses_torch_seed():
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    torch.manual_seed(7)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    c = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_kvcache_appends_and_attends_to_valid_prefix():
    b, s_cache, h, hk, d = 3, 64, 4, 2, 32
    k_cache, v_cache = torch.randn(b, s_cache, hk, d), torch.randn(b, s_cache, hk, d)
    cache_seqlens = torch.tensor([5, 0, 40], dtype=torch.int32)
    q, k_new, v_new = torch.randn(b, 2, h, d), torch.randn(b, 2, hk, d), torch.randn(b, 2, hk, d)
    k_before = k_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=True)
    for i, n in enumerate(cache_seqlens.tolist()):
        assert torch.equal(k_cache[i, n:n + 2], k_new[i]) and torch.equal(k_cache[i, :n], k_before[i, :n])
        ref = naive_attention(q[i:i + 1], k_cache[i:i + 1, :n + 2], v_cache[i:i + 1, :n + 2], causal=True)
        assert_close(out[i:i + 1], ref, 1e-5, f"row {i}")


# ------------------------------------------------------------------------------- learned attention sinks

def _sink_naive_lse(q, k, sinks, causal, window):
    """log(sum of visible exp(scores) + exp(sink)) per (B, H, Sq), from naive_attention's own math."""
    b, sq, h, d = q.shape
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // k.shape[2], dim=2)) * d**-0.5
    rows, cols = torch.arange(sq), torch.arange(k.shape[1])
    mask = reference._visible(rows, cols, sq, k.shape[1], window[0], 0 if causal else window[1])
    s = s.masked_fill(~mask, -math.inf)
    return torch.logaddexp(torch.logsumexp(s, -1), sinks[None, :, None])


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window,softcap", [GRID[0], GRID[2], GRID[4], GRID[5], GRID[6], GRID[9]])
def test_sinks_match_naive_float64(b, sq, sk, h, hk, d, causal, window, softcap):
    """Learned sinks: forward, LSE (the sink included; the sink alone on rows with no visible key) and the
    gradients of q, k, v and the sinks, against the sink as an extra softmax column."""
    torch.manual_seed(0)
    q, k, v, sinks = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d), rand(h)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sinks, **opts)
    ref = naive_attention(q, k, v, sinks=sinks, **opts)
    assert_close(out, ref, 1e-10, "out")
    assert not torch.equal(out, naive_attention(q, k, v, **opts))  # the sinks matter
    if softcap == 0:
        assert_close(lse.double(), _sink_naive_lse(q, k, sinks, causal, window).detach(), 1e-5, "lse")
    dout = torch.randn_like(out)
    for name, g, g_ref in zip(["q", "k", "v", "sinks"], grads(out, (q, k, v, sinks), dout),
                              grads(ref, (q, k, v, sinks), dout)):
        assert_close(g, g_ref, 1e-9 * max(1.0, g_ref.abs().max().item()), f"d{name}")


def test_sinks_on_fully_masked_rows_give_zero_output_and_the_sink_lse():
    q, k, v, sinks = rand(1, 6, 2, 8), rand(1, 3, 2, 8), rand(1, 3, 2, 8), rand(2)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sinks)
    empty = slice(0, 3)  # sq > sk, bottom-right causal: the first 3 rows see no key
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.allclose(lse[0, :, empty], sinks.float().detach()[:, None].expand(2, 3))
    dq, dsinks = grads(out, (q, sinks), torch.randn_like(out))
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty])) and torch.isfinite(dsinks).all()


def test_kvcache_with_sinks():
    torch.manual_seed(2)
    b, s_cache, h, hk, d = 3, 32, 4, 2, 16
    k_cache, v_cache = torch.randn(b, s_cache, hk, d, dtype=F64), torch.randn(b, s_cache, hk, d, dtype=F64)
    q, sinks = torch.randn(b, 2, h, d, dtype=F64), torch.randn(h, dtype=F64)
    seqlens = torch.tensor([7, 0, 30], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 0], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                       causal=True, window_size=(4, 0), learnable_sink=sinks,
                                       return_softmax_lse=True)
    for i in range(b):
        lo, hi = int(leftpad[i]), int(seqlens[i])
        ref = naive_attention(q[i:i + 1], k_cache[i:i + 1, lo:hi], v_cache[i:i + 1, lo:hi], causal=True,
                              window_size=(4, 0), sinks=sinks)
        assert_close(out[i:i + 1], ref, 1e-10, f"row {i}")
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no key: the sink takes the whole row
    assert torch.allclose(lse[1], sinks.float()[:, None].expand(h, 2))


@pytest.mark.parametrize("sinks,error,match", [
    (torch.zeros(4, dtype=torch.int64), TypeError, "learnable_sink must be a float32"),
    (torch.zeros(3), ValueError, r"learnable_sink must have shape \(4,\)"),
    (torch.zeros(2, 4), ValueError, "learnable_sink must have shape"),
    ([0.0] * 4, TypeError, "learnable_sink"),
])
def test_bad_sinks_raise(sinks, error, match):
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(error, match=match):
        flash_attn_func(q, q, q, learnable_sink=sinks)
    with pytest.raises(error, match=match):
        flash_attn_with_kvcache(q, q.clone(), q.clone(), learnable_sink=sinks)


# ------------------------------------------------------------------------------- relative position bias (T5)


def _rel_bias_by_hand(q, k, v, table, causal):
    """Dense attention with the documented rule written out per (query, key): the scaled logit of query i, key j
    gets table[h, clamp(j - i - (sk - sq), -R, R) + R]."""
    b, sq, h, d = q.shape
    sk, r = k.shape[1], (table.shape[1] - 1) // 2
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // k.shape[2], dim=2)) * d**-0.5
    bias = torch.empty(h, sq, sk, dtype=s.dtype)
    for i in range(sq):
        for j in range(sk):
            bias[:, i, j] = table[:, min(max(j - i - (sk - sq), -r), r) + r]
    s = s + bias
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(h // k.shape[2], dim=2))


@pytest.mark.parametrize("sq,sk,radius", [(5, 9, 2), (9, 5, 1), (6, 6, 0), (4, 7, 20)])
def test_rel_bias_rule_by_hand(sq, sk, radius):
    torch.manual_seed(4)
    q, k, v, table = rand(2, sq, 4, 8), rand(2, sk, 2, 8), rand(2, sk, 2, 8), rand(4, 2 * radius + 1)
    for causal in (False, True):
        out = flash_attn_func(q, k, v, causal=causal, rel_bias=table)
        assert_close(out, _rel_bias_by_hand(q, k, v, table, causal), 1e-10, f"out causal={causal}")
        assert_close(naive_attention(q, k, v, causal=causal, rel_bias=table), out, 1e-10, "naive_attention")


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window,softcap", [GRID[0], GRID[2], GRID[3], GRID[4], GRID[5], GRID[9]])
@pytest.mark.parametrize("radius", [0, 6, 400])  # a per-head constant, clamped, past every distance
def test_rel_bias_matches_naive_float64(b, sq, sk, h, hk, d, causal, window, softcap, radius):
    """Forward and the gradients of q, k, v and the table (autograd of the reference, and reference.bwd, the
    kernels' twin) against naive attention with the table."""
    torch.manual_seed(1)
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    table = (2 * torch.randn(h, 2 * radius + 1, dtype=F64)).requires_grad_()
    opts = dict(causal=causal, window_size=window)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, rel_bias=table, **opts)
    ref = naive_attention(q, k, v, rel_bias=table, **opts)
    assert_close(out, ref, 1e-10, "out")
    if radius:
        assert not torch.allclose(out, naive_attention(q, k, v, **opts))  # the bias matters
    dout = torch.randn_like(out)
    g_ref = grads(ref, (q, k, v, table), dout)
    twin = reference.bwd(dout, q, k, v, out.detach(), lse, None, None, sq, sk, d**-0.5, causal, *window, 0.0, None,
                         0.0, None, rel_bias=table.detach())
    for name, g, gt, gr in zip(["q", "k", "v", "rel_bias"], grads(out, (q, k, v, table), dout), twin, g_ref):
        tol = max(1.0, gr.abs().max().item())
        assert_close(g, gr, 1e-9 * tol, f"d{name}")
        assert_close(gt, gr, 2e-5 * tol, f"d{name} (reference.bwd)")  # P from the float32 LSE
    if radius == 0 and window == (-1, -1) and not causal:
        assert_close(g_ref[3], torch.zeros_like(g_ref[3]), 1e-9, "a constant bias cancels")


@pytest.mark.parametrize("causal,window,hk,radius", [(True, (-1, -1), 2, 3), (False, (-1, -1), 4, 100),
                                                     (True, (8, 0), 1, 5)])
@pytest.mark.parametrize("shared", ["learnable_sink", "rel_bias"])
def test_shared_parameter_varlen_matches_per_sequence(shared, causal, window, hk, radius):
    """A per-head parameter every sequence shares (learned sinks, a relative bias table whose positions count
    within each sequence), empty sequences included: each sequence matches its own attention and the parameter's
    gradient sums over the sequences."""
    torch.manual_seed(5)
    batch, h, d = 5, 4, 16
    cu_q, len_q = _random_cu_seqlens(batch, 40)
    cu_k, len_k = _random_cu_seqlens(batch, 50)
    q, k, v = rand(int(cu_q[-1]), h, d), rand(int(cu_k[-1]), hk, d), rand(int(cu_k[-1]), hk, d)
    param = rand(h) if shared == "learnable_sink" else (2 * torch.randn(h, 2 * radius + 1, dtype=F64)).requires_grad_()
    naive_name = {"learnable_sink": "sinks", "rel_bias": "rel_bias"}[shared]
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(len_q.max()), int(len_k.max()), causal=causal,
                                 window_size=window, **{shared: param})
    dout = torch.randn_like(out)
    dq, dk, dv, dparam = grads(out, (q, k, v, param), dout)
    dparam_ref = torch.zeros_like(dparam)
    for i in range(batch):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if qs.stop == qs.start:
            continue
        args = [t[None].detach().requires_grad_() for t in (q[qs], k[ks], v[ks])] + [param.detach().requires_grad_()]
        ref = naive_attention(*args[:3], causal=causal, window_size=window, **{naive_name: args[3]})
        assert_close(out[qs], ref[0], 1e-10, f"out[seq {i}]")
        g_ref = grads(ref, args, dout[qs][None])
        for name, g, gr, sl in zip("qkv", (dq, dk, dv), g_ref, (qs, ks, ks)):
            assert_close(g[sl], gr[0], 1e-9 * max(1.0, gr.abs().max().item() if gr.numel() else 1.0),
                         f"d{name}[seq {i}]")
        dparam_ref += g_ref[3]
    assert_close(dparam, dparam_ref, 1e-9 * max(1.0, dparam_ref.abs().max().item()), f"d{naive_name}")


def test_kvcache_with_rel_bias():
    """A row's keys are [cache_leftpad, end): its relative positions count from its left padding."""
    torch.manual_seed(6)
    b, s_cache, h, hk, d, radius = 3, 32, 4, 2, 16, 4
    k_cache, v_cache = torch.randn(b, s_cache, hk, d, dtype=F64), torch.randn(b, s_cache, hk, d, dtype=F64)
    q, table = torch.randn(b, 3, h, d, dtype=F64), torch.randn(h, 2 * radius + 1, dtype=F64)
    k_new, v_new = torch.randn(b, 2, hk, d, dtype=F64), torch.randn(b, 2, hk, d, dtype=F64)
    seqlens = torch.tensor([7, 0, 28], dtype=torch.int32)
    leftpad = torch.tensor([2, 1, 9], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                  causal=True, rel_bias=table)
    for i in range(b):
        lo, hi = int(leftpad[i]), int(seqlens[i]) + 2
        ref = naive_attention(q[i:i + 1], k_cache[i:i + 1, lo:hi], v_cache[i:i + 1, lo:hi], causal=True,
                              rel_bias=table)
        assert_close(out[i:i + 1], ref, 1e-10, f"row {i}")


def test_rel_bias_refuses_softcap():
    q, table = torch.randn(1, 3, 4, 8), torch.zeros(4, 5)
    with pytest.raises(ValueError, match="rel_bias cannot be combined with softcap"):
        flash_attn_func(q, q, q, softcap=5.0, rel_bias=table)
    with pytest.raises(ValueError, match="rel_bias cannot be combined with softcap"):
        flash_attn_with_kvcache(q, q.clone(), q.clone(), softcap=5.0, rel_bias=table)
    flash_attn_func(q, q, q, deterministic=True, rel_bias=table.requires_grad_()).sum().backward()  # fine on CPU
    assert table.grad is not None
