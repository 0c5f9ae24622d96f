"""The public API: argument checking, op registration (opcheck), torch.compile."""

import inspect
import random

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
    (lambda q, k, v: (torch.randn(2, 8, 4, 257), torch.randn(2, 8, 4, 257), torch.randn(2, 8, 4, 257)),
     ValueError, "head_dim must be in 1..256"),
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
    (torch.tensor([0, 4, 10]), TypeError, "cu_seqlens_q must be a 1-D int32"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), ValueError, "non-decreasing"),
    (torch.tensor([0, 4, 9], dtype=torch.int32), ValueError, "end at 10"),
    (torch.tensor([1, 4, 10], dtype=torch.int32), ValueError, "start at 0"),
])
def test_bad_cu_seqlens_raise_clear_errors(cu, error, message):
    with pytest.raises(error, match=message):
        _varlen(cu)


def test_mismatched_cu_seqlens_lengths():
    with pytest.raises(ValueError, match="same length"):
        _varlen(torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32))


def test_kvcache_rejects_unsupported_options():
    q, k, v = qkv(sq=1, sk=16)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, k, v, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q, k, v, k=k[:, :1])


def _op_args(q, k, v, dropout_p=0.0):
    rng = torch.randint(0, 2**62, (2,)) if dropout_p else None
    return (q, k, v, None, None, None, q.shape[1], k.shape[1], q.shape[-1] ** -0.5, True, -1, -1, 0.0, None,
            dropout_p, rng, False)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_opcheck_fwd(dropout_p):
    q, k, v = (t.requires_grad_() for t in qkv(b=1, sq=5, sk=9, h=4, hk=2, d=16))
    torch.library.opcheck(torch.ops.hf_flash.fwd.default, _op_args(q, k, v, dropout_p))


def test_opcheck_bwd():
    q, k, v = qkv(b=1, sq=5, sk=9, h=4, hk=2, d=16)
    out, lse = torch.ops.hf_flash.fwd(*_op_args(q, k, v))
    args = (torch.randn_like(out), q, k, v, out, lse, None, None, 5, 9, 0.25, True, -1, -1, 0.0, None, 0.0, None,
            False)
    torch.library.opcheck(torch.ops.hf_flash.bwd.default, args)


def test_compile_fullgraph_forward_and_backward():
    """Our ops are opaque to dynamo: no graph break, and autograd flows through them."""
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
