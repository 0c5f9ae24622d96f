"""The attention backends the kernel benchmarks compare, as callables on flash-attn layouts.

hf_flash; FlashAttention-4 ("fa4", the CuTe-DSL ``flash_attn.cute``, a column whenever it imports); FlexAttention
("flex", compiled; the features it expresses as a score_mod: T5's relative bias, softcap); SDPA
forced to one backend ("sdpa-cudnn", "sdpa-flash", ...) or left to pick its own ("sdpa"), GQA through
``enable_gqa``, as transformers calls it.
Dense tensors are ``(B, S, H, D)``, packed ones ``(total, H, D)``, KV caches ``(B, S_cache, H_k, D)``
(hf_flash, FA4) or ``(B, H_k, S_cache, D)`` (SDPA, as transformers keeps them).
"""
from __future__ import annotations

import contextlib
import functools

import torch

DEVICE = "cuda"  # the CPU tests run the measurement code on "cpu"
FA4 = "fa4"
FLEX = "flex"  # FlexAttention (torch.nn.attention.flex_attention, compiled): the feature as a score_mod
SDPA = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math")
SDPA_DEFAULT = "sdpa"  # SDPA choosing its backend itself, as transformers calls it


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
    unknown = [b for b in requested if b not in ("hf_flash", FA4, FLEX, *SDPA, SDPA_DEFAULT)]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from hf_flash, {FA4}, {FLEX}, {', '.join(SDPA)}, "
                         f"{SDPA_DEFAULT}")
    return [b for b in requested if b != FA4 or fa4_available()]


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}[name]


def _sdpa_context(name: str):
    """Makes a context per call (sdpa_kernel's serves one ``with``) forcing SDPA backend ``name``, or none for
    SDPA_DEFAULT; resolved here, once, so that the timed calls pay no lookup."""
    if name == SDPA_DEFAULT:
        return contextlib.nullcontext
    from torch.nn.attention import sdpa_kernel

    forced = sdpa_backend(name)
    return lambda: sdpa_kernel(forced)


def _first(out):
    """FA4 returns (out, lse) in some versions, out in others."""
    return out[0] if isinstance(out, tuple) else out


def dense(backend: str, causal: bool, window: int = -1, dropout_p: float = 0.0, softcap: float = 0.0):
    """f(q, k, v, sinks=None, rel_bias=None) -> out on (B, S, H, D); k/v may have fewer heads (GQA); ``window``
    >= 0 limits each query to that many earlier keys (causal sliding window); ``sinks`` are learned per-head
    logits (gpt-oss); ``rel_bias`` is T5's relative position bias in the backend's form (``rel_bias_input``);
    ``dropout_p`` drops attention probabilities as in training; ``softcap`` > 0 caps the scores (Gemma 2). SDPA has
    no window, sinks or softcap, FA4 no relative bias or dropout (NotImplementedError)."""
    if backend == "hf_flash":
        from hf_flash import flash_attn_func

        return lambda q, k, v, sinks=None, rel_bias=None: flash_attn_func(
            q, k, v, dropout_p=dropout_p, causal=causal, window_size=(window, -1), softcap=softcap,
            learnable_sink=sinks, rel_bias=rel_bias)
    if backend == FA4:
        if dropout_p:
            raise NotImplementedError(f"{FA4} has no attention dropout")
        func = fa4()[0]
        extra = {"window_size": (window, None)} if window >= 0 else {}
        extra.update({"softcap": softcap} if softcap else {})

        def fa4_dense(q, k, v, sinks=None, rel_bias=None):
            if rel_bias is not None:
                raise NotImplementedError(f"{FA4} has no relative position bias")
            return _first(func(q, k, v, causal=causal, learnable_sink=sinks, **extra))

        return fa4_dense
    if backend == FLEX:
        return _flex(causal, window, dropout_p, softcap)
    if window >= 0:
        raise NotImplementedError(f"{backend}: no sliding window without a materialised mask")
    if softcap:
        raise NotImplementedError(f"{backend} has no softcap")
    context = _sdpa_context(backend)

    def sdpa(q, k, v, sinks=None, rel_bias=None):
        if sinks is not None:
            raise NotImplementedError(f"{backend} has no learned sinks")
        with context():  # the mask holds the causal one: SDPA refuses is_causal with a mask
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=rel_bias, dropout_p=dropout_p,
                is_causal=causal and rel_bias is None, enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    return sdpa


@functools.lru_cache(maxsize=None)
def _flex_attention(device: str):
    """flex_attention compiled (its Triton kernels) on a GPU; the eager reference loop elsewhere (CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not _compiles(device):
        return flex_attention
    import torch._dynamo
    import torch._functorch.config

    # One graph per shape, feature and block choice: past dynamo's default limit of 8 it would run flex unfused.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._functorch.config.donated_buffer = False  # the bench reruns a backward over its retained graph
    return torch.compile(flex_attention, dynamic=False)


def _compiles(device: str) -> bool:
    return device != "cpu"


@functools.lru_cache(maxsize=16)
def _flex_block_mask(causal: bool, window: int, seqlen_q: int, seqlen_k: int, device: str):
    """The block mask of a causal (bottom-right aligned) or windowed shape, built once per shape as transformers
    builds it once per forward for all layers; None without a mask."""
    if not causal and window < 0:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    shift = seqlen_k - seqlen_q

    def visible(b, h, q_idx, kv_idx):
        seen = q_idx + shift >= kv_idx
        return seen & (q_idx + shift - kv_idx <= window) if window >= 0 else seen

    return create_block_mask(visible, None, None, seqlen_q, seqlen_k, device=device)


# Inductor's default blocks for a learnable captured table overflow shared memory at some shapes (torch 2.11,
# H100: "No valid triton configs ... out of resource", forward and backward): such a shape runs with these, the
# smaller blocks Inductor's own message suggests, found by one forward + backward probe per shape.
FLEX_SMALL_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4,
                     "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32}
_flex_options: dict = {}  # per shape key: None (the defaults compile) or FLEX_SMALL_BLOCKS


def flex_no_config(e: BaseException) -> bool:
    """Whether ``e`` is Inductor finding no kernel config for a flex shape (the one failure that falls back)."""
    return type(e).__module__.startswith("torch._inductor") and any(
        m in str(e) for m in ("out of resource", "No valid triton configs", "No choices to select"))


def flex_options_used() -> dict:
    """The shapes (key: q / k shapes, dtype, mask, feature) that run with FLEX_SMALL_BLOCKS, for the bench's notes."""
    return {k: v for k, v in _flex_options.items() if v is not None}


def _flex(causal: bool, window: int, dropout_p: float, softcap: float):
    """FlexAttention on (B, S, H, D): causal / window as a block mask, softcap and T5's relative bias (the float32
    (H, 2R+1) table, with its gradient through the captured tensor) as a score_mod; no dropout or sinks. Inductor's
    default blocks, or FLEX_SMALL_BLOCKS where it finds no config for them."""
    if dropout_p:
        raise NotImplementedError(f"{FLEX}: no attention dropout")

    def flex(q, k, v, sinks=None, rel_bias=None):
        if sinks is not None:
            raise NotImplementedError(f"{FLEX}: no learned sinks (they join the denominator, not a score)")
        if softcap and rel_bias is not None:
            raise NotImplementedError(f"{FLEX}: softcap with a relative bias (hf_flash refuses the pair too)")
        sq, sk = q.shape[1], k.shape[1]
        mods = {}
        if softcap:
            mods["score_mod"] = lambda score, b, h, q_idx, kv_idx: softcap * torch.tanh(score / softcap)
        elif rel_bias is not None:
            radius, shift = (rel_bias.shape[1] - 1) // 2, sk - sq

            def bias(score, b, h, q_idx, kv_idx):  # reference.relative_positions' rule
                return score + rel_bias[h, torch.clamp(kv_idx - q_idx - shift, -radius, radius) + radius]

            mods["score_mod"] = bias
        def call(options):
            return _flex_attention(q.device.type)(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                block_mask=_flex_block_mask(causal, window, sq, sk, str(q.device)),
                enable_gqa=k.shape[2] != q.shape[2], kernel_options=options, **mods).transpose(1, 2)

        leaves = [t for t in (q, k, v, rel_bias) if t is not None and t.requires_grad]
        key = (tuple(q.shape), tuple(k.shape), q.dtype, causal, window, softcap,
               None if rel_bias is None else tuple(rel_bias.shape), bool(leaves))
        if _compiles(q.device.type) and key not in _flex_options:
            try:  # the backward compiles at its first call: probe it too
                out = call(None)
                if leaves:
                    torch.autograd.grad(out, leaves, torch.ones_like(out))
                _flex_options[key] = None
            except Exception as e:  # noqa: BLE001  (only Inductor's failure to find a config falls back)
                if not flex_no_config(e):
                    raise
                _flex_options[key] = dict(FLEX_SMALL_BLOCKS)
        return call(_flex_options.get(key))

    return flex


def rel_bias_input(backend: str, table: torch.Tensor, seqlen: int, causal: bool, dtype) -> torch.Tensor:
    """T5's relative position bias, a float32 table (H, 2R+1), in the form ``backend``'s ``rel_bias`` takes for
    (seqlen x seqlen) attention: hf_flash the table itself; SDPA the additive mask transformers passes it for T5,
    materialised once (T5 computes it in its first layer for every layer): ``table[h, clamp(j - i, -R, R) + R]``
    as a (1, H, S, S) leaf in q's ``dtype`` requiring grad, ``finfo.min`` above the diagonal when causal."""
    if backend in ("hf_flash", FLEX):
        return table
    from hf_flash import reference

    pos = torch.arange(seqlen, device=table.device)
    index = reference.relative_positions(pos, pos, seqlen, seqlen, (table.shape[1] - 1) // 2)
    bias = reference.rel_bias_terms(table.detach(), index).to(dtype)
    if causal:
        bias = bias.masked_fill(pos[None, :] > pos[:, None], torch.finfo(dtype).min)
    return bias.requires_grad_()


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
    q = torch.randn(batch, heads, 1, d, **kw)
    k, v = (torch.randn(batch, kv_heads, cache_len, d, **kw) for _ in range(2))
    mask = torch.ones(batch, 1, 1, cache_len, dtype=torch.bool, device=DEVICE)
    context = _sdpa_context(backend)

    def sdpa(attn_mask):
        with context():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                                    enable_gqa=kv_heads != heads)

    try:
        sdpa(mask)
        return lambda: sdpa(mask)
    except RuntimeError:
        return lambda: sdpa(None)
