"""LayoutLM and MarkupLM: BERT encoders that build BERT's additive extended mask
``(B, 1, 1, S)`` themselves, whatever the attention implementation; their
self-attention gets the 2-D padding mask of that mask instead, bidirectional."""

from __future__ import annotations

import importlib

from ._common import bind_padding_mask

# transformers module -> its self-attention class
CLASSES = {"transformers.models.layoutlm.modeling_layoutlm": "LayoutLMSelfAttention",
           "transformers.models.markuplm.modeling_markuplm": "MarkupLMSelfAttention"}
MODULES = tuple(CLASSES)


def applies() -> bool:
    """The self-attention classes this patch rebinds are in the loaded transformers."""
    return all(hasattr(importlib.import_module(name), cls) for name, cls in CLASSES.items())


def apply_hf_flash_to_extended_mask(model=None):
    if model is None or not applies():
        return 0
    return sum(bind_padding_mask(model, getattr(importlib.import_module(name), cls), model.config)
               for name, cls in CLASSES.items())
