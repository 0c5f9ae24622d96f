"""The public API: argument checking, the CPU path under torch.compile (the ops: tests/test_kernels_*.py)."""

import inspect
import random
import warnings

import pytest
import torch

import hf_flash
from hf_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from hf_flash.reference import naive_attention


def qkv(b=2, sq=8, sk=8, h=4, hk=4, d=32, dtype=torch.float32):
    return torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype), \
        torch.randn(b, sk, hk, d, dtype=dtype)


def test_signatures_are_explicit_for_transformers():
    """transformers detects features with inspect.signature: no *args/**kwargs."""
    for fn, needed in ((flash_attn_func, ["dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                          "deterministic", "alibi_slopes"]),
                       (flash_attn_varlen_func, ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                                 "window_size", "softcap", "deterministic", "dropout_p"])):
        params = inspect.signature(fn).parameters
        assert all(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
        assert set(needed) <= set(params)


BAD_DENSE = [
    (lambda q, k, v: (q.long(), k, v), TypeError, "q must be float16"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "share a dtype"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, "one device"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
    (lambda q, k, v: (q, k[..., :16], v), ValueError, "head dims must match"),
    (lambda q, k, v: (q, k, v[:, :4]), ValueError, "k and v must have the same shape"),
    (lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), ValueError, "multiple of key/value heads"),
    (lambda q, k, v: (torch.randn(2, 8, 4, 513), torch.randn(2, 8, 4, 513), torch.randn(2, 8, 4, 513)),
     ValueError, "head_dim must be in 1..512"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "same batch size"),
    ("q", TypeError, "q must be a torch.Tensor"),
]


@pytest.mark.parametrize("mutate,error,message", BAD_DENSE)
def test_bad_tensors_raise_clear_errors(mutate, error, message):
    q, k, v = qkv()
    args = ("not a tensor", k, v) if mutate == "q" else mutate(q, k, v)
    with pytest.raises(error, match=message):
        flash_attn_func(*args)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(window_size=(4,)), ValueError, "window_size"),
    (dict(window_size=(-3, 0)), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
])
def test_bad_options_raise_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        flash_attn_func(*qkv(), **kwargs)


def _varlen(cu_q, cu_k=None):
    q = torch.randn(10, 2, 16)
    cu_k = cu_q if cu_k is None else cu_k
    return flash_attn_varlen_func(q, q, q, cu_q, cu_k, 10, 10)


@pytest.mark.parametrize("cu,error,message", [
    (torch.tensor([0, 4, 10]), TypeError, "cu_seqlens_q must be an int32"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), ValueError, r"cu_seqlens_q\[2\]=4 < cu_seqlens_q\[1\]=6: offsets must be non-decreasing"),
    (torch.tensor([0, 4, 9], dtype=torch.int32), ValueError, r"cu_seqlens_q\[2\]=9: the last offset must equal the number of rows, 10"),
    (torch.tensor([1, 4, 10], dtype=torch.int32), ValueError, r"cu_seqlens_q\[0\]=1: offsets must start at 0"),
])
def test_bad_cu_seqlens_raise_clear_errors(cu, error, message):
    with pytest.raises(error, match=message):
        _varlen(cu)


def test_bad_index_layout_and_max_seqlen():
    cu = torch.tensor([0, 0, 4, 4, 10, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        _varlen(cu[::2])
    q = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match=r"max_seqlen_q=3 < cu_seqlens_q\[2\] - cu_seqlens_q\[1\] = 6"):
        flash_attn_varlen_func(q, q, q, cu[::2].contiguous(), cu[::2].contiguous(), 3, 10)


def test_mismatched_cu_seqlens_lengths():
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have shape \(3,\)"):
        _varlen(torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32))


def test_kvcache_rejects_unsupported_options():
    q, k, v = qkv(sq=1, sk=16)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, k, v, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q, k, v, k=k[:, :1])


def _naive_kvcache(q, k_cache, v_cache, ends, starts, **kw):
    """Row by row: naive attention over cache rows [start, end)."""
    return torch.cat([naive_attention(q[i:i + 1], k_cache[i:i + 1, s:e], v_cache[i:i + 1, s:e], **kw)
                      for i, (s, e) in enumerate(zip(starts, ends))])


@pytest.mark.parametrize("sq", [1, 3, 16])
@pytest.mark.parametrize("hk,h", [(2, 2), (2, 8)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (5, 0), 0.0), (False, (7, 2), 30.0)])
@pytest.mark.parametrize("append", [False, True])
def test_kvcache_leftpad_matches_naive(sq, hk, h, causal, window, softcap, append):
    """Ragged left padding and lengths on a static cache stored (B, Hk, S, D) and viewed as (B, S, Hk, D)."""
    b, s_cache, d = 5, 48, 24
    storage = torch.randn(2, b, hk, s_cache, d, dtype=torch.float64)
    k_cache, v_cache = storage[0].transpose(1, 2), storage[1].transpose(1, 2)
    ends = [1, 30, 47, 9, 12]  # after appending
    starts = [0, 3, 40, 9, 0]  # row 3 is all padding: zero output, LSE +inf
    q = torch.randn(b, sq, h, d, dtype=torch.float64)
    s_new = 1 if append else 0
    new = (torch.randn(b, s_new, hk, d, dtype=torch.float64) for _ in range(2)) if append else (None, None)
    seqlens = torch.tensor(ends, dtype=torch.int32) - s_new
    leftpad = torch.tensor(starts, dtype=torch.int32)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                       return_softmax_lse=True, **kw)
    assert k_cache.data_ptr() == storage[0].data_ptr()  # written in place, never copied
    ref = _naive_kvcache(q, k_cache, v_cache, ends, starts, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    assert lse.shape == (b, h, sq) and lse[3].isposinf().all() and out[3].eq(0).all()
    if not causal and window == (-1, -1):
        assert torch.isfinite(lse[[0, 1, 2, 4]]).all()


def test_kvcache_without_leftpad_equals_zero_leftpad():
    q, k, v = qkv(b=3, sq=2, sk=20, h=4, hk=2, d=16)
    seqlens = torch.tensor([20, 7, 0], dtype=torch.int32)
    a = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
    b = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, cache_leftpad=torch.zeros(3, dtype=torch.int32))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(cache_seqlens=torch.tensor([4, 4])), TypeError, "cache_seqlens must be an int32"),
    (dict(cache_seqlens=torch.tensor([4.0, 4.0])), TypeError, "cache_seqlens must be an int32"),
    (dict(cache_seqlens=torch.tensor([4, 4, 4], dtype=torch.int32)), ValueError, r"cache_seqlens must have shape \(2,\)"),
    (dict(cache_seqlens=torch.tensor([4, 4], dtype=torch.int32, device="meta")), ValueError, "cache_seqlens must be on cpu"),
    (dict(cache_seqlens=torch.tensor([4, 17], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\]=17 \+ 0 new keys > cache length 16"),
    (dict(cache_seqlens=torch.tensor([4, -1], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\]=-1 < 0"),
    (dict(cache_seqlens=17), ValueError, r"cache_seqlens=17 \(\+ 0 new keys\) must be in \[0, cache length 16\]"),
    (dict(cache_seqlens=torch.arange(4, dtype=torch.int32)[::2]), ValueError, "cache_seqlens must be contiguous"),
    (dict(cache_leftpad=[0, 0]), TypeError, "cache_leftpad must be an int32"),
    (dict(cache_leftpad=torch.tensor([0, 0])), TypeError, "cache_leftpad must be an int32"),
    (dict(cache_leftpad=torch.zeros(2, 1, dtype=torch.int32)), ValueError, r"cache_leftpad must have shape \(2,\)"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError, "cache_leftpad must be on cpu"),
    (dict(cache_seqlens=torch.tensor([4, 4], dtype=torch.int32), cache_leftpad=torch.tensor([0, 5], dtype=torch.int32)),
     ValueError, r"cache_leftpad\[1\]=5 must be in \[0, cache_seqlens\[1\] \+ new keys = 4\]"),
    (dict(cache_leftpad=torch.tensor([0, -2], dtype=torch.int32)), ValueError, r"cache_leftpad\[1\]=-2 must be in \[0, cache_seqlens\[1\] \+ new keys = 16\]"),
    (dict(num_splits=-1), ValueError, "num_splits"),
])
def test_kvcache_bad_lengths_raise_clear_errors(kwargs, error, message):
    q, k, v = qkv(sq=1, sk=16)
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(q, k, v, **kwargs)


def test_kvcache_compile_fullgraph():
    q, k, v = qkv(b=2, sq=1, sk=16, h=4, hk=2, d=16)
    seqlens, leftpad = torch.tensor([16, 9], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)

    def step(q, k, v, seqlens, leftpad):
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, causal=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, seqlens, leftpad), step(q, k, v, seqlens, leftpad))


def test_compile_fullgraph_forward_and_backward():
    """The CPU path (the reference, plain torch code) compiles without graph breaks, forward and backward.
    The ops on the GPU: tests/test_kernels_*.py."""
    q, k, v = (t.requires_grad_() for t in qkv(b=1, sq=12, sk=12, h=4, hk=2, d=16))

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(4, 0)).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_grads = torch.autograd.grad(step(q, k, v), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_random_configurations_match_naive():
    """A few fresh random shapes every run, beyond the fixed grid in test_reference."""
    rng = random.Random(torch.initial_seed())
    for _ in range(6):
        hk = rng.choice([1, 2, 4])
        h, d = hk * rng.choice([1, 2, 8]), rng.randint(1, 256)
        sq, sk = rng.randint(1, 160), rng.randint(1, 160)
        causal = rng.random() < 0.5
        window = (rng.choice([-1, rng.randint(0, 40)]), rng.choice([-1, rng.randint(0, 40)]))
        softcap = rng.choice([0.0, 20.0])
        q, k, v = qkv(b=rng.randint(1, 3), sq=sq, sk=sk, h=h, hk=hk, d=d, dtype=torch.float64)
        out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
        ref = naive_attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"{m} (h={h}, hk={hk}, d={d}, sq={sq}, sk={sk}, causal={causal}, "
                                                 f"window={window}, softcap={softcap})")


def test_env_report_names_the_active_path():
    report = hf_flash.env_report()
    assert "hf_flash" in report and "registered" in report
    assert "reference path" in report or "cuda path" in report


def test_wide_dtype_on_gpu_warns_once(monkeypatch):
    """float32 on a GPU runs the reference path: one warning naming it and the way to the kernels."""
    from hf_flash import checks

    monkeypatch.setattr(checks, "_is_cuda", lambda t: True)
    monkeypatch.setattr(checks, "_warned_wide", False)
    q = torch.randn(1, 4, 2, 16)
    with pytest.warns(UserWarning, match=r"float32 inputs on a GPU run the PyTorch reference path.*bfloat16.*autocast"):
        flash_attn_func(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(q, q, q)  # once per process
        flash_attn_func(q.half(), q.half(), q.half())  # 16-bit inputs never warn


def test_index_checks_read_flag_once():
    from hf_flash import checks

    assert checks.CHECK_VALUES  # tests/conftest.py sets HF_FLASH_CHECK=1 before hf_flash is imported
