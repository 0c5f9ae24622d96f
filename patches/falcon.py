"""Falcon (rotary variants): causal GQA/MQA attention, scale 1/sqrt(head_dim).

Loading with hf_flash would fail with a KeyError in ``FALCON_ATTENTION_CLASSES``;
the eager class is used and its ``forward`` runs on hf_flash. Falcon configs
with ``alibi=True`` (falcon-rw) are refused at load: their ALiBi is added in
bfloat16 before scaling, which the kernels' fp32 slopes do not reproduce.
"""

from __future__ import annotations

from ._common import NAME, attend, bind_all, computes_attention_itself

MODULE = "transformers.models.falcon.modeling_falcon"


def unsupported(config):
    if getattr(config, "alibi", False):
        return "falcon with alibi=True (bfloat16 ALiBi added before scaling) is not supported by hf_flash"
    return None


def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
            output_attentions=False, position_embeddings=None, **kwargs):
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    if alibi is not None:
        raise ValueError(unsupported(self.config) or "falcon ALiBi is not supported by hf_flash")
    num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query, key, value = self._split_heads(self.query_key_value(hidden_states))
    batch_size, query_length = query.shape[:2]
    query = query.transpose(1, 2).reshape(batch_size, self.num_heads, query_length, self.head_dim)
    key = key.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
    value = value.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    # falcon's eager rotary path applies no attention dropout
    out = attend(query, key, value, attention_mask, causal=True, scale=self.head_dim**-0.5)
    return self.dense(out.reshape(batch_size, query_length, self.num_heads * self.head_dim)), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.falcon import modeling_falcon as m

    return hasattr(m, "FALCON_ATTENTION_CLASSES") and computes_attention_itself(m.FalconAttention)


def apply_hf_flash_to_falcon(model=None):
    if not applies():
        return 0
    from transformers.models.falcon import modeling_falcon as m

    m.FALCON_ATTENTION_CLASSES.setdefault(NAME, m.FalconAttention)
    if model is not None:
        return bind_all(model, m.FalconAttention, "forward", forward, model.config)
