"""Registers ``attn_implementation="hf_flash"`` with transformers (5.17 and newer 5.x).

transformers' own flash-attention wrapper does the layout work (BSHD
transpose, unpadding of padded batches, packed sequences from ``position_ids``
or ``cu_seq_lens_*``, static-cache slicing, sliding window and softcap
arguments); it looks its kernels up by implementation name, so we hand it ours.
Three traps make that more than one ``register`` call (see the integration
notes in the repository's docs):

* any name containing "flash" goes through ``_lazy_imports``, which would
  try to download a hub kernel called "hf_flash": we answer that lookup;
* an unregistered mask function silently drops padding: we register the
  flash-attention mask (2-D ``(batch, kv)`` bool) for our name;
* models with ``_compatible_flash_implementations`` rewrite any flash name to
  their own kernel: ``hf_flash.patches`` adds ours to the list of the class being loaded.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import interface

logger = logging.getLogger("hf_flash")

NAME = "hf_flash"
PAGED_NAME = f"paged|{NAME}"
MIN_TRANSFORMERS = (5, 17)


class UnsupportedAttentionError(ValueError):
    """An attention feature that hf_flash does not implement (it never silently changes the math)."""


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The function transformers calls for every attention layer (AttentionInterface)."""
    from transformers.integrations.flash_attention import flash_attention_forward

    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttentionError(
            f"hf_flash does not support attention sinks (s_aux), used by {type(module).__name__}; "
            "load this model with attn_implementation='eager' or 'sdpa'")
    for extra in ("sinks", "position_bias"):  # score terms the flash wrapper would silently drop (inkling)
        if kwargs.get(extra) is not None:
            raise UnsupportedAttentionError(
                f"hf_flash cannot add {extra!r} to the attention scores, used by {type(module).__name__}; "
                "load this model with attn_implementation='eager' or 'sdpa'")
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
                                kwargs.get("softcap"))
    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _is_cross_attention(module, is_causal: bool) -> bool:
    """Decoder attention over encoder states (Bart/M2M100/Pegasus-style and BERT-style decoders)."""
    return "CrossAttention" in type(module).__name__ or (getattr(module, "is_decoder", False) and not is_causal)


def _cross_attention(query, key, value, key_mask, dropout: float, scaling, softcap):
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
        softcap=softcap or 0.0)
    return out.view(b, sq, h, -1), None


def _kernels():
    """What transformers' ``_lazy_imports`` returns for our name."""
    from transformers import modeling_flash_attention_utils as mfau

    return (interface.flash_attn_func, interface.flash_attn_varlen_func, interface.flash_attn_with_kvcache,
            mfau._pad_input, mfau._unpad_input)


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
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    _install_lazy_import_hook(mfau)
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

