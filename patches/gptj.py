"""GPT-J: rotary causal attention, scores scaled by 1/sqrt(head_dim).

Loading with hf_flash would fail with a KeyError in ``GPTJ_ATTENTION_CLASSES``;
the eager class is used and its ``_attn`` runs on hf_flash.
"""

from __future__ import annotations

from ._common import NAME, attend, bind_all, dropout_p

MODULE = "transformers.models.gptj.modeling_gptj"


def _attn(self, query, key, value, attention_mask=None):
    out = attend(query.to(value.dtype), key.to(value.dtype), value, attention_mask, causal=True,
                 scale=1.0 / float(self.scale_attn), dropout=dropout_p(self))
    return out.transpose(1, 2), None


def apply_hf_flash_to_gptj(model=None):
    from transformers.models.gptj import modeling_gptj as m

    m.GPTJ_ATTENTION_CLASSES.setdefault(NAME, m.GPTJAttention)
    if model is not None:
        return bind_all(model, m.GPTJAttention, "_attn", _attn, model.config)
