"""MPT: causal attention with ALiBi (``position_bias``), run as hf_flash's ``alibi_slopes``.

MPT adds ``slope_h * (j - L + 1)`` to the scores, linear in the key position
``j``: within a causal row that is ALiBi's ``-slope_h * (i - j)`` plus a
per-row constant. The slopes are read off the ``position_bias`` the model
passes in (its last two columns differ by exactly one slope).
"""

from __future__ import annotations

import torch

from ._common import attend, bind_all, computes_attention_itself

MODULE = "transformers.models.mpt.modeling_mpt"


def forward(self, hidden_states, position_bias, past_key_values=None, attention_mask=None, **kwargs):
    batch_size, seq_length = hidden_states.shape[:2]
    mixed_qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (t.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
                         for t in mixed_qkv.chunk(3, dim=2))
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    slopes = None
    if position_bias is not None:
        if position_bias.dim() != 3 or position_bias.shape[-1] < 2:
            raise ValueError(f"MPT position_bias must be (heads, 1, max_seq_len >= 2), got {tuple(position_bias.shape)}")
        slopes = (position_bias[:, 0, -1] - position_bias[:, 0, -2]).float()
    if attention_mask is not None:
        attention_mask = attention_mask.bool()
    out = attend(query, key, value, attention_mask, causal=True, scale=self.softmax_scale,
                 dropout=self.attn_dropout_p if self.training else 0.0, alibi_slopes=slopes)
    return self.out_proj(out.reshape(batch_size, seq_length, -1)), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.mpt import modeling_mpt as m

    return computes_attention_itself(m.MptAttention)


def apply_hf_flash_to_mpt(model=None):
    if not applies():
        return 0
    from transformers.models.mpt import modeling_mpt as m

    if model is not None:
        return bind_all(model, m.MptAttention, "forward", forward, model.config)
