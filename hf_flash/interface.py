"""Public functional API, with flash-attn 2's signatures and semantics.

* ``(B, S, H, D)`` tensors; GQA/MQA by passing fewer key/value heads.
* ``causal`` aligns the mask to the bottom-right corner when ``seqlen_q != seqlen_k``.
* ``window_size=(left, right)``, ``-1`` = unbounded; ``softcap`` > 0 applies
  ``softcap * tanh(s / softcap)`` to the scaled scores.
* Rows with no visible key return 0 (and LSE = +inf, so their gradients are 0).

Parameters are explicit (no ``*args``): transformers inspects these signatures
to decide which features to pass.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _build, checks, ops

MAX_HEAD_DIM = _build.head_dims()[-1]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t, dims: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.dim() != dims:
        layout = "(batch, seqlen, heads, head_dim)" if dims == 4 else "(total_tokens, heads, head_dim)"
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def _check_qkv(q, k, v, dims: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, dims)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM or d < 1:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v head dims must match, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    h, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"number of query heads ({h}) must be a multiple of key/value heads ({hk})")


def _checked_by_op(q) -> bool:
    """On the kernel path the C++ op checks the tensors itself (ValueError / TypeError naming them), so the
    eager call does no per-tensor Python work; the reference path is checked here."""
    return isinstance(q, Tensor) and ops.uses_kernels(q)


def _check_options(q, dropout_p, window_size, softcap, alibi_slopes, batch: int) -> tuple[int, int]:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}")
    wl, wr = int(window_size[0]), int(window_size[1])
    if wl < -1 or wr < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a float32 tensor of shape (heads,) or (batch, heads)")
        h = q.shape[-2]
        if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
            raise ValueError(f"alibi_slopes must have shape ({h},) or ({batch}, {h}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes must be on {q.device}, got {alibi_slopes.device}")
    return wl, wr


def _check_sinks(q: Tensor, learnable_sink) -> None:
    """Learned attention sinks: one logit per query head, float32 or q's dtype (transformers casts gpt-oss's
    ``s_aux`` to q's dtype), on q's device."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, Tensor) or learnable_sink.dtype not in (torch.float32, q.dtype):
        got = learnable_sink.dtype if isinstance(learnable_sink, Tensor) else type(learnable_sink).__name__
        raise TypeError(f"learnable_sink must be a float32 or {q.dtype} tensor, got {got}")
    h = q.shape[-2]
    if tuple(learnable_sink.shape) != (h,):
        raise ValueError(f"learnable_sink must have shape ({h},) (one logit per query head), "
                         f"got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != q.device:
        raise ValueError(f"learnable_sink must be on {q.device}, got {learnable_sink.device}")


def _check_rel_bias(q: Tensor, rel_bias, softcap: float, deterministic: bool = False, grads=()) -> None:
    """A relative position bias table: (heads, 2R+1) floating point on q's device; not with softcap (no model
    combines them, and the backward's bias gradient is the logit's, before softcap); not with deterministic
    training on the kernels (their d rel_bias sums use atomics)."""
    if rel_bias is None:
        return
    if not isinstance(rel_bias, Tensor) or not rel_bias.is_floating_point():
        got = rel_bias.dtype if isinstance(rel_bias, Tensor) else type(rel_bias).__name__
        raise TypeError(f"rel_bias must be a floating-point tensor, got {got}")
    h = q.shape[-2]
    if rel_bias.dim() != 2 or rel_bias.shape[0] != h or rel_bias.shape[1] % 2 != 1:
        raise ValueError(f"rel_bias must have shape ({h}, 2 * radius + 1) (one row per query head, columns for "
                         f"relative positions -radius..radius), got {tuple(rel_bias.shape)}")
    if rel_bias.device != q.device:
        raise ValueError(f"rel_bias must be on {q.device}, got {rel_bias.device}")
    if softcap > 0:
        raise ValueError("rel_bias cannot be combined with softcap > 0")
    if deterministic and torch.is_grad_enabled() and any(t.requires_grad for t in (q, *grads, rel_bias)) \
            and ops.uses_kernels(q):
        raise ValueError("deterministic=True does not cover rel_bias's gradient on the CUDA kernels yet (its sums "
                         "use atomics); pass deterministic=False")


def _rng_state(q: Tensor, dropout_p: float) -> Optional[Tensor]:
    """Philox (seed, offset) drawn from torch's generator: reproducible under
    torch.manual_seed, graph-capturable, and saved for the backward."""
    if dropout_p == 0.0:
        return None
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=q.device)


def _scale(q: Tensor, softmax_scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _run(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
         deterministic, return_attn_probs, learnable_sink, rel_bias):
    _check_sinks(q, learnable_sink)
    _check_rel_bias(q, rel_bias, softcap, deterministic, (k, v))
    out, lse = ops.run_fwd(q, k, v, cu_q, cu_k, max_q, max_k, _scale(q, softmax_scale), bool(causal), window[0],
                           window[1], float(softcap), alibi_slopes, float(dropout_p), _rng_state(q, dropout_p),
                           bool(deterministic), sinks=learnable_sink, rel_bias=rel_bias)
    if return_attn_probs:
        return out, lse, None  # flash-attn's third value (the P matrix) is testing-only; never materialised
    return out


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, learnable_sink: Optional[Tensor] = None,
                    rel_bias: Optional[Tensor] = None):
    """Attention on ``(B, S, H, D)`` tensors. With ``return_attn_probs=True``
    returns ``(out, lse, None)``, lse being float32 ``(B, H, Sq)``. ``learnable_sink`` (H,): learned attention
    sinks (gpt-oss), one logit per query head in each row's softmax denominator, with a gradient; the LSE
    returned then includes it. ``rel_bias`` (H, 2R+1): a relative position bias (T5's bucketed table, expanded
    per relative position): the scaled logit of query i and key j gets ``rel_bias[h, clamp(j - i - (Sk - Sq),
    -R, R) + R]``, positions counted within each sequence and aligned bottom-right like the causal mask; it
    has a gradient (not with ``softcap``; ``deterministic=True`` covers it on the reference path only)."""
    if not _checked_by_op(q):
        _check_qkv(q, k, v, 4)
        checks.note_reference_dtype(q)
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    window = _check_options(q, dropout_p, window_size, softcap, alibi_slopes, q.shape[0])
    return _run(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale, causal, window,
                softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink, rel_bias)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None,
                           learnable_sink: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None):
    """Attention on packed ``(total_tokens, H, D)`` tensors; sequence ``b`` is
    rows ``cu_seqlens[b]:cu_seqlens[b+1]``. LSE is float32 ``(H, total_q)``. ``learnable_sink``, ``rel_bias``:
    as in ``flash_attn_func`` (relative positions within each sequence)."""
    if not _checked_by_op(q):
        _check_qkv(q, k, v, 3)
        checks.note_reference_dtype(q)
    if block_table is not None:
        raise ValueError("block_table (paged KV cache) is not supported by hf_flash yet; pass contiguous k/v")
    max_seqlen = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, Tensor):
            value = int(value)
        if not isinstance(value, int) or value < 0:
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
        max_seqlen.append(value)
    batch = checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen[0], q.device)
    checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen[1], q.device, batch)
    window = _check_options(q, dropout_p, window_size, softcap, alibi_slopes, batch)
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
                softmax_scale, causal, window, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink,
                rel_bias)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens=None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False,
                            learnable_sink: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None):
    """Decode/prefill against a KV cache ``(B, S_cache, H_k, D)`` (inference only).

    The cache may be a strided view (e.g. a ``(B, H_k, S_cache, D)`` cache transposed) and longer than
    its valid rows (static cache); it is never copied. ``cache_seqlens`` (int or int32 ``(B,)``) is the
    end of each row's valid keys; new ``k``/``v`` ``(B, S_new, H_k, D)`` are written in place at those
    positions first, moving the end to ``cache_seqlens + S_new``. ``cache_leftpad`` (int32 ``(B,)``)
    is where each row's keys start (left padding), so row ``b`` attends to cache rows
    ``[cache_leftpad[b], end[b])``; causal masks and windows align bottom-right to that range.
    ``num_splits`` splits the keys of short queries across thread blocks on the GPU: 0 = automatic,
    1 = no split. ``learnable_sink``, ``rel_bias``: as in ``flash_attn_func`` (relative positions of the row's
    keys ``[cache_leftpad, end)``: the new queries are its last positions).
    """
    _check_qkv(q, k_cache, v_cache, 4)
    checks.note_reference_dtype(q)
    unsupported = {"rotary_cos": rotary_cos, "rotary_sin": rotary_sin, "cache_batch_idx": cache_batch_idx,
                   "block_table": block_table}
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(f"flash_attn_with_kvcache: {name} is not supported by hf_flash yet")
    b, s_cache = k_cache.shape[0], k_cache.shape[1]
    if k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"k_cache batch ({k_cache.shape[0]}) must equal q batch ({q.shape[0]})")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append to the cache, or neither")
    if k is not None:
        _check_qkv(q, k, v, 4)
        if k.shape[0] != b or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"new k/v {tuple(k.shape)} do not match the cache {tuple(k_cache.shape)}")
    s_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        seqlens = torch.full((b,), s_cache - s_new, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        checks.cache_length(cache_seqlens, s_new, s_cache)
        seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        seqlens = checks.index_tensor("cache_seqlens", cache_seqlens, b, q.device, "one entry per batch row")
    if cache_leftpad is not None:
        checks.index_tensor("cache_leftpad", cache_leftpad, b, q.device, "one entry per batch row")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic, 1 = no split), got {num_splits!r}")
    checks.cache_ranges(seqlens, cache_leftpad, s_new, s_cache)  # before the append writes at those rows
    window = _check_options(q, 0.0, window_size, softcap, alibi_slopes, b)
    _check_sinks(q, learnable_sink)
    _check_rel_bias(q, rel_bias, softcap)
    if k is not None:
        pos = seqlens[:, None].long() + torch.arange(s_new, device=q.device)  # (B, S_new)
        rows = torch.arange(b, device=q.device)[:, None].expand_as(pos)
        k_cache.index_put_((rows, pos), k)  # out-of-range positions raise inside torch
        v_cache.index_put_((rows, pos), v)
        seqlens = seqlens + s_new
    with torch.no_grad():
        out, lse = ops.run_fwd_kvcache(q, k_cache, v_cache, seqlens, cache_leftpad, _scale(q, softmax_scale),
                                       bool(causal), window[0], window[1], float(softcap), alibi_slopes, num_splits,
                                       sinks=learnable_sink, rel_bias=rel_bias)
    return (out, lse) if return_softmax_lse else out
