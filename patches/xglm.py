"""XGLM: causal self-attention (and bidirectional cross-attention when the
config adds it); queries are pre-scaled by ``self.scaling``."""

from __future__ import annotations

from ._common import attend, bind_all, cached_key_value, computes_attention_itself, dropout_p

MODULE = "transformers.models.xglm.modeling_xglm"


def forward(self, hidden_states, key_value_states=None, past_key_values=None, attention_mask=None, **kwargs):
    is_cross = key_value_states is not None
    bsz, tgt_len, _ = hidden_states.size()
    query = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
    current = key_value_states if is_cross else hidden_states

    def project():
        return tuple(proj(current).view(bsz, current.shape[1], -1, self.head_dim).transpose(1, 2)
                     for proj in (self.k_proj, self.v_proj))

    key, value = cached_key_value(self, past_key_values, is_cross, project)
    out = attend(query, key, value, attention_mask, causal=not is_cross, scale=1.0,
                 dropout=dropout_p(self, "dropout"))
    return self.out_proj(out.reshape(bsz, tgt_len, self.embed_dim)), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.xglm import modeling_xglm as m

    return computes_attention_itself(m.XGLMAttention)


def apply_hf_flash_to_xglm(model=None):
    if not applies():
        return 0
    from transformers.models.xglm import modeling_xglm as m

    if model is not None:
        return bind_all(model, m.XGLMAttention, "forward", forward, model.config)
