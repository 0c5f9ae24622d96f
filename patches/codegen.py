"""CodeGen: rotary causal attention; ``_attn`` (scale 1/sqrt(head_dim)) runs on hf_flash."""

from __future__ import annotations

from ._common import attend, bind_all, dropout_p

MODULE = "transformers.models.codegen.modeling_codegen"


def _attn(self, query, key, value, attention_mask=None):
    out = attend(query.to(value.dtype), key.to(value.dtype), value, attention_mask, causal=True,
                 scale=1.0 / float(self.scale_attn), dropout=dropout_p(self))
    return out.transpose(1, 2), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.codegen import modeling_codegen as m

    return hasattr(m.CodeGenAttention, "_attn")


def apply_hf_flash_to_codegen(model=None):
    if not applies():
        return 0
    from transformers.models.codegen import modeling_codegen as m

    if model is not None:
        return bind_all(model, m.CodeGenAttention, "_attn", _attn, model.config)
