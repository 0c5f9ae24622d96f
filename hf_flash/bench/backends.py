"""The attention backends the kernel benchmarks compare, as callables on flash-attn layouts.

hf_flash; FlashAttention-4 ("fa4", the CuTe-DSL ``flash_attn.cute``, a column whenever it imports); SDPA
forced to one backend ("sdpa-cudnn", "sdpa-flash", ...; GQA through ``enable_gqa``, as transformers calls it).
Dense tensors are ``(B, S, H, D)``, packed ones ``(total, H, D)``, KV caches ``(B, S_cache, H_k, D)``
(hf_flash, FA4) or ``(B, H_k, S_cache, D)`` (SDPA, as transformers keeps them).
"""
from __future__ import annotations

import functools

import torch

DEVICE = "cuda"  # the CPU tests run the measurement code on "cpu"
FA4 = "fa4"
SDPA = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math")


@functools.lru_cache(maxsize=1)
def fa4() -> tuple:
    """(flash_attn_func, flash_attn_varlen_func, None) when FlashAttention-4 imports, else (None, None, why)."""
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001  (missing, or its compiler library is absent or broken)
        return None, None, f"{type(e).__name__}: {e}"
    return flash_attn_func, flash_attn_varlen_func, None


def fa4_available() -> bool:
    return fa4()[0] is not None


def available(requested: list[str]) -> list[str]:
    """``requested`` without fa4 when FlashAttention-4 does not import; an unknown name is a ValueError."""
    unknown = [b for b in requested if b not in ("hf_flash", FA4, *SDPA)]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from hf_flash, {FA4}, {', '.join(SDPA)}")
    return [b for b in requested if b != FA4 or fa4_available()]


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}[name]


def _first(out):
    """FA4 returns (out, lse) in some versions, out in others."""
    return out[0] if isinstance(out, tuple) else out


def dense(backend: str, causal: bool, window: int = -1):
    """f(q, k, v, sinks=None) -> out on (B, S, H, D); k/v may have fewer heads (GQA); ``window`` >= 0 limits
    each query to that many earlier keys (causal sliding window); ``sinks`` are learned per-head logits
    (gpt-oss). SDPA has neither (NotImplementedError)."""
    if backend == "hf_flash":
        from hf_flash import flash_attn_func

        return lambda q, k, v, sinks=None: flash_attn_func(q, k, v, causal=causal, window_size=(window, -1),
                                                           learnable_sink=sinks)
    if backend == FA4:
        func = fa4()[0]
        extra = {"window_size": (window, None)} if window >= 0 else {}
        return lambda q, k, v, sinks=None: _first(func(q, k, v, causal=causal, learnable_sink=sinks, **extra))
    if window >= 0:
        raise NotImplementedError(f"{backend}: no sliding window without a materialised mask")
    from torch.nn.attention import sdpa_kernel

    forced = sdpa_backend(backend)

    def sdpa(q, k, v, sinks=None):
        if sinks is not None:
            raise NotImplementedError(f"{backend} has no learned sinks")
        with sdpa_kernel(forced):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    return sdpa


def varlen(backend: str, causal: bool, cu_seqlens: torch.Tensor, max_seqlen: int):
    """f(q, k, v) -> out on packed (total, H, D) documents; SDPA has no packed form (NotImplementedError)."""
    if backend == "hf_flash":
        from hf_flash import flash_attn_varlen_func

        return lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                      causal=causal)
    if backend == FA4:
        func = fa4()[1]
        return lambda q, k, v: _first(func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                           max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=causal))
    raise NotImplementedError(f"{backend} has no packed (varlen) form")


def decode(backend: str, batch: int, cache_len: int, heads: int, kv_heads: int, d: int, dtype):
    """A zero-argument call attending one new token per sequence to a full cache of ``cache_len`` keys, as
    generation's decode step does: hf_flash's flash_attn_with_kvcache, FA4's varlen function with
    ``seqused_k`` (it has no kvcache function), SDPA with a boolean attention mask (as transformers passes
    with padding; a backend that refuses masks is called without, which is the same attention here)."""
    kw = {"device": DEVICE, "dtype": dtype}
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=DEVICE)
    if backend in ("hf_flash", FA4):
        q = torch.randn(batch, 1, heads, d, **kw)
        k, v = (torch.randn(batch, cache_len, kv_heads, d, **kw) for _ in range(2))
        if backend == "hf_flash":
            from hf_flash import flash_attn_with_kvcache

            return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
        func = fa4()[1]
        return lambda: _first(func(q, k, v, seqused_k=seqlens, causal=True))
    from torch.nn.attention import sdpa_kernel

    forced = sdpa_backend(backend)
    q = torch.randn(batch, heads, 1, d, **kw)
    k, v = (torch.randn(batch, kv_heads, cache_len, d, **kw) for _ in range(2))
    mask = torch.ones(batch, 1, 1, cache_len, dtype=torch.bool, device=DEVICE)

    def sdpa(attn_mask):
        with sdpa_kernel(forced):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                                    enable_gqa=kv_heads != heads)

    try:
        sdpa(mask)
        return lambda: sdpa(mask)
    except RuntimeError:
        return lambda: sdpa(None)
