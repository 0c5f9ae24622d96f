"""XGLM: causal self-attention (and bidirectional cross-attention when the
config adds it); queries are pre-scaled by ``self.scaling``."""

from __future__ import annotations

from ._common import attend, bind_all, dropout_p

MODULE = "transformers.models.xglm.modeling_xglm"


def forward(self, hidden_states, key_value_states=None, past_key_values=None, attention_mask=None, **kwargs):
    from transformers.cache_utils import EncoderDecoderCache

    is_cross = key_value_states is not None
    bsz, tgt_len, _ = hidden_states.size()
    query = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
    cache, is_updated = past_key_values, False
    if past_key_values is not None and isinstance(past_key_values, EncoderDecoderCache):
        is_updated = past_key_values.is_updated.get(self.layer_idx)
        cache = past_key_values.cross_attention_cache if is_cross else past_key_values.self_attention_cache
    current = key_value_states if is_cross else hidden_states
    if is_cross and past_key_values is not None and is_updated:
        key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
    else:
        key = self.k_proj(current).view(bsz, current.shape[1], -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(current).view(bsz, current.shape[1], -1, self.head_dim).transpose(1, 2)
        if past_key_values is not None:
            key, value = cache.update(key, value, self.layer_idx)
            if is_cross and isinstance(past_key_values, EncoderDecoderCache):
                past_key_values.is_updated[self.layer_idx] = True
    out = attend(query, key, value, attention_mask, causal=not is_cross, scale=1.0,
                 dropout=dropout_p(self, "dropout"))
    return self.out_proj(out.reshape(bsz, tgt_len, self.embed_dim)), None


def apply_hf_flash_to_xglm(model=None):
    from transformers.models.xglm import modeling_xglm as m

    if model is not None:
        return bind_all(model, m.XGLMAttention, "forward", forward, model.config)
