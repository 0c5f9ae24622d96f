"""GPT-J: rotary causal attention, scores scaled by 1/sqrt(head_dim).

Loading with hf_flash would fail with a KeyError in ``GPTJ_ATTENTION_CLASSES``;
the eager class is used and its ``_attn`` runs on hf_flash.
transformers >= 5.23 builds the ``*FlashAttention2`` subclass for any name
containing "flash"; its instances get the eager ``forward`` back (the flash one
calls ``_flash_attention_forward``, imported only with flash_attn installed).
"""

from __future__ import annotations

from ._common import NAME, attend, bind_all, bind_eager_forward, dropout_p

MODULE = "transformers.models.gptj.modeling_gptj"


def _attn(self, query, key, value, attention_mask=None):
    out = attend(query.to(value.dtype), key.to(value.dtype), value, attention_mask, causal=True,
                 scale=1.0 / float(self.scale_attn), dropout=dropout_p(self))
    return out.transpose(1, 2), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.gptj import modeling_gptj as m

    return hasattr(m, "GPTJ_ATTENTION_CLASSES") and hasattr(m.GPTJAttention, "_attn")


def apply_hf_flash_to_gptj(model=None):
    if not applies():
        return 0
    from transformers.models.gptj import modeling_gptj as m

    m.GPTJ_ATTENTION_CLASSES.setdefault(NAME, m.GPTJAttention)
    if model is not None:
        bind_eager_forward(model, m.GPTJAttention, model.config)  # 5.23+ builds the FlashAttention2 subclass
        return bind_all(model, m.GPTJAttention, "_attn", _attn, model.config)
