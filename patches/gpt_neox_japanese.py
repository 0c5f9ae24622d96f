"""GPT-NeoX-Japanese: rotary causal attention; ``_attn`` (scale 1/norm_factor) runs on hf_flash."""

from __future__ import annotations

from ._common import attend, bind_all, dropout_p

MODULE = "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese"


def _attn(self, query, key, value, attention_mask=None):
    out = attend(query, key.to(query.dtype), value.to(query.dtype), attention_mask, causal=True,
                 scale=1.0 / float(self.norm_factor), dropout=dropout_p(self, "attention_dropout"))
    return out.transpose(1, 2), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as m

    return hasattr(m.GPTNeoXJapaneseAttention, "_attn")


def apply_hf_flash_to_gpt_neox_japanese(model=None):
    if not applies():
        return 0
    from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as m

    if model is not None:
        return bind_all(model, m.GPTNeoXJapaneseAttention, "_attn", _attn, model.config)
