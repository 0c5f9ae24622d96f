"""Learned attention sinks on the CUDA kernels (in the forward / decode epilogues, d sink in the op's backward)
against the reference in float32: forward, LSE and the gradients of q, k, v and the sinks, dense, varlen and
decode, with GQA, sliding windows and fully masked rows. Rule: ``max|ours - ref| <= 3 * max|torch_same_precision
- ref| + max(eps, 1e-3) * max(1, max|ref|)``, torch_same_precision being ``naive_attention`` in the input dtype
and eps the result dtype's (one rounding of a gradient summed over many rows, d sink)."""

import pytest
import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from hf_flash.reference import naive_attention

pytestmark = pytest.mark.gpu

# (sq, sk, h, hk, d, causal, window): gpt-oss's d64 GQA with full and windowed layers, fully masked rows
CASES = [
    (128, 128, 8, 1, 64, True, (-1, -1)),
    (300, 300, 8, 2, 64, True, (127, 0)),
    (200, 130, 4, 2, 64, True, (-1, -1)),  # sq > sk: rows with no visible key
    (77, 333, 4, 4, 128, False, (-1, -1)),
]


def _check(name, ours, ref, same_precision):
    base = (same_precision.float() - ref.float()).abs().max().item()
    err = (ours.float() - ref.float()).abs().max().item()
    bound = 3 * base + max(torch.finfo(ours.dtype).eps, 1e-3) * max(1.0, ref.abs().max().item())  # + rounding
    assert not torch.isnan(ours).any(), f"{name}: NaN"
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g} (torch in the same dtype: {base:.3g})"


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


@pytest.mark.parametrize("sq,sk,h,hk,d,causal,window", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_forward_and_gradients(sq, sk, h, hk, d, causal, window, dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, s, n, d, device="cuda") for s, n in ((sq, h), (sk, hk), (sk, hk)))
    sinks = torch.randn(h, device="cuda") * 2
    low = _leaves(q.to(dtype), k.to(dtype), v.to(dtype), sinks.to(dtype))
    out = flash_attn_func(*low[:3], causal=causal, window_size=window, learnable_sink=low[3])
    ref_in, same_in = _leaves(q, k, v, sinks), _leaves(*low)
    ref = naive_attention(*ref_in[:3], causal=causal, window_size=window, sinks=ref_in[3])
    same = naive_attention(*same_in[:3], causal=causal, window_size=window, sinks=same_in[3])
    _check("out", out, ref, same)
    dout = torch.randn_like(ref)
    for name, g, g_ref, g_same in zip(["q", "k", "v", "sinks"], torch.autograd.grad(out, low, dout.to(dtype)),
                                      torch.autograd.grad(ref, ref_in, dout),
                                      torch.autograd.grad(same, same_in, dout.to(dtype))):
        assert g.dtype == dtype
        _check(f"d{name}", g, g_ref, g_same)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (31, 0))])
def test_varlen_forward_and_gradients(causal, window):
    torch.manual_seed(1)
    dtype, h, hk, d = torch.bfloat16, 8, 2, 64
    lens_q, lens_k = [37, 0, 129, 64], [37, 5, 129, 200]
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda")
    k, v = (torch.randn(sum(lens_k), hk, d, device="cuda") for _ in range(2))
    sinks = torch.randn(h, device="cuda")
    low = _leaves(q.to(dtype), k.to(dtype), v.to(dtype), sinks)  # float32 sinks with bf16 q, k, v
    out = flash_attn_varlen_func(*low[:3], cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=causal,
                                 window_size=window, learnable_sink=low[3])
    dout = torch.randn_like(q)
    grads = torch.autograd.grad(out, low, dout.to(dtype))
    dsinks_ref = torch.zeros_like(sinks)
    dsinks_same = torch.zeros_like(sinks)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for i in range(len(lens_q)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if qs.start == qs.stop:
            continue
        ref_in = _leaves(q[qs][None], k[ks][None], v[ks][None], sinks)
        same_in = _leaves(*(t.to(dtype) for t in ref_in[:3]), sinks)
        ref = naive_attention(*ref_in[:3], causal=causal, window_size=window, sinks=ref_in[3])
        same = naive_attention(*same_in[:3], causal=causal, window_size=window, sinks=same_in[3])
        _check(f"out[{i}]", out[qs], ref[0], same[0])
        g_ref = torch.autograd.grad(ref, ref_in, dout[qs][None])
        g_same = torch.autograd.grad(same, same_in, dout[qs][None].to(dtype))
        for name, g, gr, gs, sl in zip("qkv", grads[:3], g_ref, g_same, (qs, ks, ks)):
            _check(f"d{name}[{i}]", g[sl], gr[0], gs[0])
        dsinks_ref += g_ref[3]
        dsinks_same += g_same[3]
    _check("dsinks", grads[3], dsinks_ref, dsinks_same)


@pytest.mark.parametrize("sq", [1, 4])
def test_decode(sq):
    torch.manual_seed(2)
    dtype, b, s_cache, h, hk, d = torch.bfloat16, 3, 1024, 8, 1, 64
    k_cache, v_cache = (torch.randn(b, s_cache, hk, d, device="cuda") for _ in range(2))
    q, sinks = torch.randn(b, sq, h, d, device="cuda"), torch.randn(h, device="cuda")
    seqlens = torch.tensor([1000, 0, 17], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), cache_seqlens=seqlens,
                                  causal=True, window_size=(127, 0), learnable_sink=sinks.to(dtype))
    for i, n in enumerate(seqlens.tolist()):
        args = (q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
        ref = naive_attention(*args, causal=True, window_size=(127, 0), sinks=sinks)
        same = naive_attention(*(t.to(dtype) for t in args), causal=True, window_size=(127, 0),
                               sinks=sinks.to(dtype))
        _check(f"row {i}", out[i:i + 1], ref, same)
