"""Registers ``attn_implementation="hf_flash"`` with transformers (5.17 and newer 5.x).

transformers' own flash-attention wrapper does the layout work (BSHD
transpose, unpadding of padded batches, packed sequences from ``position_ids``
or ``cu_seq_lens_*``, static-cache slicing, sliding window and softcap
arguments); it looks its kernels up by implementation name, so we hand it ours.
Three traps make that more than one ``register`` call (docs/architecture.md):

* any name containing "flash" goes through ``_lazy_imports``, which would
  try to download a hub kernel called "hf_flash": we answer that lookup;
* an unregistered mask function silently drops padding: we register the
  flash-attention mask (2-D ``(batch, kv)`` bool) for our name;
* models with ``_compatible_flash_implementations`` rewrite any flash name to
  their own kernel: ``hf_flash.patches`` adds ours to the list of the class being loaded.

The wrapper unpads a padded batch in every layer with two host syncs (``_get_unpad_data``): in our calls the
result is kept on the mask, which every layer of a forward shares, so it is worked out once per forward.

Generation steps (at most ``ops.DECODE_MAX_SEQLEN_Q`` new tokens against a KV cache) skip the wrapper,
which unpads with ``nonzero()`` and a host sync in every layer and gathers the whole cache: they
call ``flash_attn_with_kvcache`` on transformers' cache tensors as they are (a static cache's
buffer too), each row's keys being the run of ones of its padding mask, found by tensor ops.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os

import torch

from . import interface, ops

logger = logging.getLogger("hf_flash")

NAME = "hf_flash"
PAGED_NAME = f"paged|{NAME}"
MIN_TRANSFORMERS = (5, 17)

# Keyword arguments a model's attention call may pass by name that hf_flash carries: the call's tensors, what
# transformers' flash wrapper hands to the kernels (scale, dropout, causality, window, softcap, varlen layout),
# flags checked per call, and learned attention sinks (s_aux, which the wrapper passes as learnable_sink). A
# model whose attention call passes any other keyword (a score term: sinks=, position_bias=, a sparse indexer's
# indices=) refuses at load, since the wrapper would silently drop it (``hf_flash.patches.check_supported``).
# Carrying a new score term is adding its name here.
CARRIED_ATTENTION_KWARGS = frozenset({
    "module", "query", "key", "value", "attention_mask", "scaling", "dropout", "is_causal", "sliding_window",
    "softcap", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "deterministic",
    "output_attentions", "s_aux",
})


class UnsupportedAttentionError(ValueError):
    """An attention feature that hf_flash does not implement (it never silently changes the math)."""


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The function transformers calls for every attention layer (AttentionInterface)."""
    if kwargs.get("sinks") is not None:  # a score term the flash wrapper would silently drop (inkling)
        _refuse_score_term(module, "sinks")
    rel_bias = _rel_bias(module, kwargs.get("position_bias"))
    if kwargs.get("output_attentions"):
        raise UnsupportedAttentionError("hf_flash never materialises attention weights; "
                                        "use attn_implementation='eager' with output_attentions=True")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedAttentionError(
            f"hf_flash takes a 2-D (batch, kv_len) padding mask, got a {attention_mask.dim()}-D mask from "
            f"{type(module).__name__}: this model builds custom masks that flash attention cannot express")
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is not None and _is_cross_attention(module, is_causal):
        return _cross_attention(query, key, value, attention_mask, kwargs.get("dropout", 0.0), kwargs.get("scaling"),
                                kwargs.get("softcap"), kwargs.get("s_aux"), rel_bias)
    if is_causal and _is_decode_step(module, query, key, value, attention_mask, kwargs):
        ranges = _key_ranges(attention_mask, query)
        if ranges is not None:
            return _decode(query, key, value, *ranges, kwargs, rel_bias), None
    if rel_bias is not None:  # the flash wrapper has no relative bias to pass on
        return _attend_with_rel_bias(module, query, key, value, attention_mask, is_causal, rel_bias, kwargs), None
    from transformers.integrations.flash_attention import flash_attention_forward

    if kwargs.get("position_ids") is not None:
        if query.shape[0] > 1:
            # Only a batch of one can be packed; transformers 5.17's check computes its tensors first (six launches
            # a layer) and looks at the batch size after.
            kwargs = {**kwargs, "position_ids": None}
        elif query.shape[0] == 1 and attention_mask is None and kwargs.get("cu_seq_lens_q") is None \
                and not _capturing(query):
            kwargs = {**kwargs, **_packing(kwargs["position_ids"])}
    token = _IN_WRAPPER.set(True)  # our call: the wrapper's unpadding data may come from the mask's cache
    try:
        return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)
    finally:
        _IN_WRAPPER.reset(token)


def _refuse_score_term(module, name: str):
    raise UnsupportedAttentionError(
        f"hf_flash cannot add {name!r} to the attention scores, used by {type(module).__name__}; "
        "load this model with attn_implementation='eager' or 'sdpa'")


def _rel_bias(module, position_bias):
    """The relative position bias table a model's ``position_bias`` carries, or None.

    A 2-D ``(H, 2R + 1)`` tensor is the table that ``hf_flash.patches.t5`` makes T5-family modules build; a 4-D
    one from such a module is T5's zero bias of a module without a relative bias. Any other dense bias (a model
    without that patch) is refused rather than dropped."""
    if position_bias is None:
        return None
    if position_bias.dim() == 2:
        return position_bias
    from .patches.t5 import MARK

    if getattr(module, MARK, False):
        return None
    _refuse_score_term(module, "position_bias")


def _attend_with_rel_bias(module, query, key, value, mask, is_causal: bool, rel_bias, kwargs):
    """Attention with a relative position bias (the T5 family): what the flash wrapper does for these models,
    the relative bias included: float32 inputs cast to the model's dtype (autocast, 16-bit weights), the padding
    mask unpads (a static cache's prefill reads the mask's keys), or ``cu_seq_lens_*`` pack. (B, H, S, D) in,
    (B, S, H, D) out."""
    from .patches._common import attend

    target = _target_dtype(query, module) if query.dtype == torch.float32 else None
    if target is not None and target != query.dtype:
        query, key, value = (t.to(target) for t in (query, key, value))
    scale = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    dropout = kwargs.get("dropout") or 0.0
    deterministic = kwargs.get("deterministic")
    if deterministic is None:  # as the flash wrapper reads it
        deterministic = os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    if kwargs.get("cu_seq_lens_q") is not None:
        b, h, d = query.shape[0], query.shape[1], query.shape[-1]
        flat = [t.transpose(1, 2).reshape(-1, t.shape[1], d) for t in (query, key, value)]
        out = interface.flash_attn_varlen_func(
            *flat, kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int(), int(kwargs["max_length_q"]),
            int(kwargs["max_length_k"]), dropout_p=dropout, softmax_scale=scale, causal=is_causal,
            deterministic=deterministic, rel_bias=rel_bias)
        return out.view(b, -1, h, d)
    return attend(query, key, value, mask, causal=is_causal, scale=scale, dropout=dropout, rel_bias=rel_bias,
                  deterministic=deterministic)


def _packing(position_ids) -> dict:
    """The wrapper's view of a batch of one with ``position_ids``, worked out once per forward.

    The wrapper decides whether such a batch is several packed sequences with a host sync, and derives their
    ``cu_seqlens`` with more, in every layer (training at 1 x 16k: 221 ms of wall time a step for 185 ms of GPU
    time, sdpa 202 ms). The layers of one forward share the ``position_ids`` tensor: we decide once, cache the
    answer on it (keyed by its version counter, so in-place edits recompute; inference tensors have none and are
    decided per layer) and hand the wrapper ``position_ids=None`` and, when packed, the varlen arguments, which
    it uses without a sync.
    """
    from transformers import modeling_flash_attention_utils as mfau

    def decide():
        if not bool(mfau._is_packed_sequence(position_ids, 1)):
            return dict(position_ids=None)
        (cu_q, cu_k), (max_q, max_k) = mfau.prepare_fa_kwargs_from_position_ids(position_ids)
        return dict(position_ids=None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=int(max_q),
                    max_length_k=int(max_k))

    return _cached_on(position_ids, "_hf_flash_packing", decide)


def _cached_on(t, attr: str, compute):
    """``compute()``, kept on tensor ``t`` as ``attr`` and keyed by its version counter, so an in-place edit
    recomputes; inference tensors have no version counter: computed every time."""
    if t.is_inference():
        return compute()
    cached = getattr(t, attr, None)
    if cached is not None and cached[0] == t._version:
        return cached[1]
    value = compute()
    setattr(t, attr, (t._version, value))
    return value


def _is_decode_step(module, query, key, value, mask, kwargs) -> bool:
    """A few new queries against a KV cache, inference only, no packing (varlen kwargs) and no paged cache."""
    q_len, kv_len = query.shape[2], key.shape[2]
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return (q_len <= ops.DECODE_MAX_SEQLEN_Q and (kv_len > q_len or (mask is not None and mask.shape[-1] < kv_len))
            and (mask is None or mask.shape[-1] <= kv_len) and not grad and not kwargs.get("dropout")
            and all(kwargs.get(name) is None for name in ("cache", "cu_seq_lens_q", "cu_seq_lens_k"))
            and query.dtype == key.dtype == value.dtype and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and (query.dtype != torch.float32 or _target_dtype(query, module) == torch.float32))


def _target_dtype(query, module):
    """The dtype transformers' wrapper would cast float32 inputs to (autocast, quantized or 16-bit weights)."""
    from transformers.integrations.flash_attention import get_target_dtype

    return get_target_dtype(query, module)


def _capturing(t) -> bool:
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _key_ranges(mask, query):
    """Per-row key range ``[start, end)`` (int32 ``(B,)``) in the cache, and the rows it cannot express.

    Row ``b``'s keys are the ones of ``mask[b]``: left padding gives ``start``, a static cache's
    unused tail gives ``end``, with no host sync. A mask whose ones are not one run (right padding
    followed by generated tokens) has no such range: outside compilation and graph capture we
    check once per mask object (one sync per forward, not per layer) and return None, sending
    the step to transformers' wrapper; under compilation or capture we cannot, so those rows are
    returned (as ``bad``) to be set to NaN rather than silently wrong.
    """
    if mask is None:
        return None, None, None
    capturing = _capturing(mask)
    cached = None if capturing else getattr(mask, "_hf_flash_key_ranges", None)
    if cached is not None:
        return cached[0]
    valid = mask.bool()
    count = valid.sum(-1, dtype=torch.int32)
    start = valid.int().argmax(-1).int()  # first one (0 for a row without any: count 0 makes it empty)
    end = start + count
    # Where runs of ones begin. Every reduction here spans the whole mask: inductor (torch 2.11) asserts
    # when it fuses split reductions of different lengths (a long static cache's S and S - 1).
    rises = valid & ~torch.nn.functional.pad(valid[:, :-1], (1, 0))
    bad = rises.sum(-1) > 1  # more than one run of ones
    if query.shape[2] > 1:  # the queries are the last positions of the mask: the run must end there
        bad |= end != valid.shape[-1]
    if capturing:
        return start, end, bad
    ranges = None if bool(bad.any()) else (start, end, None)
    if ranges is None:
        _log_once("hf_flash: an attention mask has padding after valid tokens (right padding?); its decode steps "
                  "use transformers' unpadding path; under torch.compile or CUDA graphs such rows become NaN, so pad "
                  "on the left (tokenizer.padding_side='left')")
    mask._hf_flash_key_ranges = (ranges,)
    return ranges


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.warning(message)


def _decode(query, key, value, start, end, bad, kwargs, rel_bias=None):
    """flash_attn_with_kvcache's op on (B, S, H, D) transposed views of the (B, H, S, D) cache: no copy.
    The public function's argument checks are skipped: _is_decode_step and _key_ranges built consistent
    arguments, and a decode step's host time is what generation speed is made of."""
    b, kv_len = query.shape[0], key.shape[2]
    if end is None:
        end = torch.full((b,), kv_len, dtype=torch.int32, device=query.device)
    window = kwargs.get("sliding_window")
    scale = kwargs.get("scaling")
    out, _ = ops.run_fwd_kvcache(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), end, start,
        query.shape[-1] ** -0.5 if scale is None else float(scale), True, -1 if window is None else window - 1, 0,
        float(kwargs.get("softcap") or 0.0), None, 0, sinks=_sinks(kwargs.get("s_aux"), query), rel_bias=rel_bias)
    return out if bad is None else out.masked_fill(bad[:, None, None, None], float("nan"))


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers builds for our name: its flash-attention mask (``(B, kv)`` bool, None
    without padding), with two changes for compiled decoding on a static cache. A single-token
    step's mask, shorter than the cache, is padded with zeros to the cache length, so every step
    has one shape (one graph, one CUDA graph; the key set is unchanged). Under compilation the
    no-padding check (a host sync) is skipped: a mask of ones is handled exactly anyway."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[1] < kv_length:
        return torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1])) if q_length == 1 else mask
    if torch.compiler.is_compiling() or not bool(mask.all()):
        return mask
    return None


def _is_cross_attention(module, is_causal: bool) -> bool:
    """Decoder attention over encoder states (Bart/M2M100/Pegasus-style and BERT-style decoders)."""
    return "CrossAttention" in type(module).__name__ or (getattr(module, "is_decoder", False) and not is_causal)


def _cross_attention(query, key, value, key_mask, dropout: float, scaling, softcap, sinks=None, rel_bias=None):
    """Every query row attends to the unpadded keys of its batch row, as eager does.

    transformers' flash wrapper would unpad the queries with the encoder's key mask (sliced to the query
    length), which drops or misaligns decoder rows whenever the two sides are padded differently."""
    b, h, sq, d = query.shape
    valid = key_mask.bool()
    lengths = valid.sum(-1, dtype=torch.int32)
    cu_seqlens_k = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    cu_seqlens_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=query.device)
    out = interface.flash_attn_varlen_func(
        query.transpose(1, 2).reshape(b * sq, h, d), key.transpose(1, 2)[valid], value.transpose(1, 2)[valid],
        cu_seqlens_q, cu_seqlens_k, sq, int(lengths.max()), dropout_p=dropout, softmax_scale=scaling, causal=False,
        softcap=softcap or 0.0, learnable_sink=_sinks(sinks, query), rel_bias=rel_bias)
    return out.view(b, sq, h, -1), None


def _sinks(s_aux, query):
    """A model's learned sinks as the kernels take them: float32 kept, else in the query's dtype (as
    transformers' wrapper passes them)."""
    return s_aux if s_aux is None or s_aux.dtype == torch.float32 else s_aux.to(query.dtype)


def _kernels():
    """What transformers' ``_lazy_imports`` returns for our name."""
    from transformers import modeling_flash_attention_utils as mfau

    return (interface.flash_attn_func, interface.flash_attn_varlen_func, interface.flash_attn_with_kvcache,
            mfau._pad_input, mfau._unpad_input)


_IN_WRAPPER = contextvars.ContextVar("hf_flash_in_wrapper", default=False)


def _install_unpad_cache(mfau) -> None:
    """transformers' wrapper unpads a padded batch in every layer with ``_get_unpad_data(mask)``: a ``nonzero``
    and an ``.item()``, two host syncs a layer that leave the GPU idle while the host catches up. The layers of one
    forward share the mask tensor: within our calls (not other backends') the result is cached on it, keyed by
    its version counter so that in-place edits recompute (inference tensors have none: computed per layer, as
    are masks under compilation or graph capture)."""
    original = getattr(mfau, "_get_unpad_data", None)
    if original is None or getattr(original, "_hf_flash_hook", False):
        return

    @functools.wraps(original)
    def _get_unpad_data(attention_mask):
        if not _IN_WRAPPER.get() or _capturing(attention_mask):
            return original(attention_mask)
        return _cached_on(attention_mask, "_hf_flash_unpad", lambda: original(attention_mask))

    _get_unpad_data._hf_flash_hook = True
    mfau._get_unpad_data = _get_unpad_data


def _install_lazy_import_hook(mfau) -> None:
    original = mfau._lazy_imports
    if getattr(original, "_hf_flash_hook", False):
        return

    @functools.wraps(original)
    def _lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation is not None and implementation.removeprefix("paged|") == NAME:
            return _kernels()
        return original(implementation, attention_wrapper, allow_all_kernels=allow_all_kernels)

    _lazy_imports._hf_flash_hook = True
    mfau._lazy_imports = _lazy_imports


def _check_version(transformers) -> None:
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if version < MIN_TRANSFORMERS or version[0] != 5:
        raise ImportError(f"hf_flash supports transformers 5.x from {'.'.join(map(str, MIN_TRANSFORMERS))}, "
                          f"found {transformers.__version__}")


@functools.lru_cache(maxsize=None)
def register() -> bool:
    """Make ``attn_implementation="hf_flash"`` available; False if transformers is absent."""
    try:
        import transformers
    except ImportError:
        return False
    _check_version(transformers)
    from transformers import AttentionInterface
    from transformers import modeling_flash_attention_utils as mfau
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)
    _install_lazy_import_hook(mfau)
    _install_unpad_cache(mfau)
    from .patches import install as _install_model_patches  # legacy families: patch at load, or refuse

    _install_model_patches()
    try:  # continuous batching (generate_batch, paged cache) asks for "paged|<name>" in 5.17
        from transformers.integrations.flash_paged import paged_attention_forward

        AttentionInterface.register(PAGED_NAME, paged_attention_forward)
        AttentionMaskInterface.register(PAGED_NAME, flash_attention_mask)
    except ImportError:
        pass
    return True


def is_registered() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    return NAME in AttentionInterface._global_mapping

