"""RoFormer: rotary self-attention (and cross-attention) on hf_flash.

Self-attention is causal exactly when eager's mask is: for a decoder
(``config.is_decoder``) from transformers 5.23, which builds it with
``create_causal_mask``; 5.17 builds a bidirectional mask for every RoFormer,
``RoFormerForCausalLM`` included. Rotary embeddings (on values too with
``rotary_value``) are the module's own.
"""

from __future__ import annotations

import math

from ._common import attend, bind_all, cached_key_value, computes_attention_itself, dropout_p

MODULE = "transformers.models.roformer.modeling_roformer"


def _decoder_mask_is_causal() -> bool:
    from transformers.models.roformer import modeling_roformer

    return hasattr(modeling_roformer, "create_causal_mask")  # imported from 5.23, for decoders


def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None,
            past_key_values=None, output_attentions=False, **kwargs):
    from hf_flash.integration import _cross_attention

    is_cross = encoder_hidden_states is not None
    bsz, q_len = hidden_states.shape[:2]
    query = self.query(hidden_states).view(bsz, q_len, -1, self.attention_head_size).transpose(1, 2)
    current = encoder_hidden_states if is_cross else hidden_states

    def project():
        nonlocal query
        key, value = (proj(current).view(bsz, current.shape[1], -1, self.attention_head_size).transpose(1, 2)
                      for proj in (self.key, self.value))
        if is_cross or sinusoidal_pos is None:
            return key, value
        if self.rotary_value:
            query, key, value = self.apply_rotary_position_embeddings(sinusoidal_pos, query, key, value)
        else:
            query, key = self.apply_rotary_position_embeddings(sinusoidal_pos, query, key)
        return key, value

    key, value = cached_key_value(self, past_key_values, is_cross, project)
    scale = 1.0 / math.sqrt(self.attention_head_size)
    dropout = dropout_p(self, "dropout")
    if is_cross and attention_mask is not None:  # decoder queries over the unpadded encoder keys
        out = _cross_attention(query, key, value, attention_mask, dropout, scale, None)[0]
    else:
        causal = not is_cross and self.is_decoder and _decoder_mask_is_causal()
        out = attend(query, key, value, attention_mask, causal=causal, scale=scale, dropout=dropout)
    return out.reshape(bsz, q_len, self.all_head_size), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.roformer import modeling_roformer as m

    return computes_attention_itself(m.RoFormerSelfAttention)


def apply_hf_flash_to_roformer(model=None):
    if not applies():
        return 0
    from transformers.models.roformer import modeling_roformer as m

    if model is not None:
        return bind_all(model, m.RoFormerSelfAttention, "forward", forward, model.config)
