"""Shared pieces of the per-model patches: the attention call and instance binding.

A patch never changes a module's parameters or buffers (state-dict keys stay
as they are); it binds a replacement method on each attention module instance
(``module.__dict__``), so other models of the same class in the process are
untouched. The bound method checks the model's config at call time and falls
back to the class's own method once the model is switched away from hf_flash
(``set_attn_implementation("eager")``).
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch

NAME = "hf_flash"


def attend(query, key, value, attention_mask, *, causal: bool, scale: float, dropout: float = 0.0,
           window_left: int = -1, window_right: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None,
           rel_bias: Optional[torch.Tensor] = None, deterministic: bool = False) -> torch.Tensor:
    """Attention through hf_flash's kernels.

    ``query`` ``(B, Hq, Sq, D)``, ``key``/``value`` ``(B, Hk, Sk, D)`` (the layout
    these legacy modules use); ``attention_mask`` is the 2-D ``(B, Sk)`` padding
    mask that transformers builds for flash implementations (1 = token), or None;
    a mask shorter than the keys (a static cache's prefill) covers their first
    rows. ``window_left=w`` lets query i see keys ``i-w .. i`` (``.. i+window_right``
    when given, for bidirectional windows). ALiBi slopes are float32 ``(Hq,)``;
    ``rel_bias`` a relative position bias table (``flash_attn_func``). Returns
    ``(B, Sq, Hq, D)``.
    """
    from hf_flash.interface import flash_attn_func, flash_attn_varlen_func

    if attention_mask is not None and attention_mask.dim() != 2:
        from hf_flash.integration import UnsupportedAttentionError

        raise UnsupportedAttentionError(f"hf_flash patches take a 2-D padding mask, got {attention_mask.dim()}-D")
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    right = (0 if causal else -1) if window_right is None else window_right
    window = (window_left, right) if window_left >= 0 else (-1, -1)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
    extra = dict(alibi_slopes=alibi_slopes, rel_bias=rel_bias, deterministic=deterministic)
    if attention_mask is None or bool(attention_mask.all()):
        return flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scale, causal=causal, window_size=window,
                               **extra)
    b, sq = q.shape[:2]
    mask_k = attention_mask.bool()
    mask_q = mask_k[:, -sq:]  # queries are the last sq positions (left padding, or prefill without cache)
    q_u, idx_q, cu_q, max_q = _unpad(q, mask_q)
    k_u, _, cu_k, max_k = _unpad(k, mask_k)
    v_u = _unpad(v, mask_k)[0]
    out = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, dropout_p=dropout, softmax_scale=scale,
                                 causal=causal, window_size=window, **extra)
    padded = out.new_zeros(b * sq, *out.shape[1:])
    padded = padded.index_copy(0, idx_q, out)
    return padded.view(b, sq, *out.shape[1:])


def _unpad(x, mask):
    lengths = mask.sum(-1, dtype=torch.int32)
    idx = mask.flatten().nonzero().squeeze(-1)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:]).index_select(0, idx), idx, cu, int(lengths.max())


def cached_key_value(module, past_key_values, is_cross: bool, project: Callable):
    """Keys and values of one attention call with transformers' cache (the legacy modules' cache logic).

    Cross-attention reuses the encoder's keys/values once cached; otherwise ``project()`` returns the new
    ``(key, value)``, which are appended to the (self- or cross-attention) cache."""
    from transformers.cache_utils import EncoderDecoderCache

    cache, is_updated = past_key_values, False
    if isinstance(past_key_values, EncoderDecoderCache):
        is_updated = past_key_values.is_updated.get(module.layer_idx)
        cache = past_key_values.cross_attention_cache if is_cross else past_key_values.self_attention_cache
    if is_cross and past_key_values is not None and is_updated:
        return cache.layers[module.layer_idx].keys, cache.layers[module.layer_idx].values
    key, value = project()
    if past_key_values is not None:
        key, value = cache.update(key, value, module.layer_idx)
        if is_cross and isinstance(past_key_values, EncoderDecoderCache):
            past_key_values.is_updated[module.layer_idx] = True
    return key, value


def padding_mask_from_extended(mask):
    """The 2-D ``(B, S)`` key-padding mask (True = token) of BERT's extended mask ``(B, 1, 1, S)``.

    The extended mask is additive (0 for a token, a large negative number for padding) or bool (True = token);
    None when nothing is padded. A per-query mask or an additive score bias raises: flash attention cannot
    carry it."""
    from hf_flash.integration import UnsupportedAttentionError

    if mask is None or mask.dim() == 2:
        return mask
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise UnsupportedAttentionError(f"hf_flash patches take a (batch, 1, 1, keys) extended padding mask, "
                                        f"got shape {tuple(mask.shape)}")
    keys = mask[:, 0, 0, :]
    valid = keys if keys.dtype == torch.bool else keys == 0
    if keys.dtype != torch.bool and not bool((valid | (keys <= -1e4)).all()):
        raise UnsupportedAttentionError("hf_flash patches take an additive padding mask of 0 and large negative "
                                        "values; this one adds other values (a score bias) to the scores")
    return None if bool(valid.all()) else valid


def bind_padding_mask(model: torch.nn.Module, attention_cls: type, config) -> int:
    """Encoders that build BERT's extended mask themselves, whatever the implementation: every
    ``attention_cls(hidden_states, attention_mask, **kwargs)`` gets the 2-D padding mask instead and is
    marked bidirectional (such modules have no ``is_causal``, which the flash path reads as causal)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return attention_cls.forward(self, hidden_states, padding_mask_from_extended(attention_mask), **kwargs)

    for module in model.modules():
        if isinstance(module, attention_cls):
            module.is_causal = False
    return bind_all(model, attention_cls, "forward", forward, config)


def dropout_p(module, attr: str = "attn_dropout") -> float:
    """The attention dropout a module applies in training (an nn.Dropout attribute or a float)."""
    if not module.training:
        return 0.0
    d = getattr(module, attr, 0.0)
    return float(d.p if isinstance(d, torch.nn.Dropout) else (d or 0.0))


def computes_attention_itself(cls: type) -> bool:
    """True while ``cls.forward`` computes attention in its own code, not through transformers' attention
    interface: a patch replacing that forward applies only then (a later transformers may move the class onto
    the interface, where it runs on hf_flash without a patch)."""
    import inspect

    return "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(cls.forward)


def uses_hf_flash(config) -> bool:
    impl = getattr(config, "_attn_implementation", None)
    return isinstance(impl, str) and impl.removeprefix("paged|") == NAME


def bind(module: torch.nn.Module, name: str, fn: Callable, config) -> None:
    """Bind ``fn`` as ``module.<name>`` (this instance only), active while ``config`` asks for hf_flash."""
    original = getattr(type(module), name)
    module._hf_flash_config = config  # a plain attribute: no parameter or buffer, so no state-dict key

    def method(self, *args, **kwargs):
        if uses_hf_flash(self._hf_flash_config):
            return fn(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    method.__name__ = name
    method._hf_flash_patch = fn
    module.__dict__[name] = types.MethodType(method, module)


def is_patched(module: torch.nn.Module, name: str = "forward") -> bool:
    return hasattr(module.__dict__.get(name), "_hf_flash_patch")


def bind_eager_forward(model: torch.nn.Module, eager_cls: type, config) -> int:
    """Run ``eager_cls.forward`` on every instance of a subclass that overrides it (this instance only).

    transformers >= 5.23 builds the legacy ``*FlashAttention2`` subclass for any implementation name
    containing "flash" (``is_flash_attention_requested``); its forward calls ``_flash_attention_forward``,
    a name its module imports only when flash_attn is installed. The eager forward calls ``_attn``,
    which the patches rebind onto hf_flash, so the patch does not depend on that name.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, eager_cls) and type(module).forward is not eager_cls.forward:
            bind(module, "forward", eager_cls.forward, config)
            n += 1
    return n


def bind_all(model: torch.nn.Module, classes, name: str, fn: Callable, config) -> int:
    """Bind ``fn`` on every submodule of one of ``classes``; returns how many."""
    n = 0
    for module in model.modules():
        if isinstance(module, classes):
            bind(module, name, fn, config)
            n += 1
    return n
