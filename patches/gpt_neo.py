"""GPT-Neo: alternating global and local (sliding-window) causal attention.

Loading with hf_flash would fail with a KeyError in ``GPT_NEO_ATTENTION_CLASSES``;
the eager class is used and its score computation ``_attn`` runs on hf_flash.
transformers >= 5.23 builds the ``*FlashAttention2`` subclass for any name
containing "flash"; its instances get the eager ``forward`` back (the flash one
calls ``_flash_attention_forward``, imported only with flash_attn installed).
GPT-Neo does not scale its scores (softmax scale 1.0); a local layer lets token
i see the ``window_size`` tokens ``i-window_size+1 .. i``.
"""

from __future__ import annotations

from ._common import NAME, attend, bind_all, bind_eager_forward, dropout_p

MODULE = "transformers.models.gpt_neo.modeling_gpt_neo"


def _attn(self, query, key, value, attention_mask=None):
    window = self.config.window_size - 1 if self.attention_type == "local" else -1
    out = attend(query, key, value, attention_mask, causal=True, scale=1.0, dropout=dropout_p(self),
                 window_left=window)
    return out.transpose(1, 2), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.gpt_neo import modeling_gpt_neo as m

    return hasattr(m, "GPT_NEO_ATTENTION_CLASSES") and hasattr(m.GPTNeoSelfAttention, "_attn")


def apply_hf_flash_to_gpt_neo(model=None):
    if not applies():
        return 0
    from transformers.models.gpt_neo import modeling_gpt_neo as m

    m.GPT_NEO_ATTENTION_CLASSES.setdefault(NAME, m.GPTNeoSelfAttention)
    if model is not None:
        bind_eager_forward(model, m.GPTNeoSelfAttention, model.config)  # 5.23+ builds the FlashAttention2 subclass
        return bind_all(model, m.GPTNeoSelfAttention, "_attn", _attn, model.config)
