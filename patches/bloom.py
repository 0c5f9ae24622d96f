"""BLOOM: causal attention with ALiBi, run as hf_flash's ``alibi_slopes``.

BLOOM adds ``slope_h * position_j`` (positions counted over non-pad tokens) to
the scores; within a causal row that differs from ALiBi's
``-slope_h * (i - j)`` by a per-row constant, which softmax ignores. The slopes
are read from the model's own ``build_alibi_tensor``, so they match exactly.
"""

from __future__ import annotations

import functools

import torch

from ._common import attend, bind_all, computes_attention_itself, dropout_p

MODULE = "transformers.models.bloom.modeling_bloom"


@functools.lru_cache(maxsize=None)
def _slopes(num_heads: int) -> torch.Tensor:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # (H, 1, 2): slope * (0, 1)
    return (bias[:, 0, 1] - bias[:, 0, 0]).contiguous()


def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
            output_attentions=False, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    # BLOOM's ALiBi is *added* to the scaled scores: slopes are not scaled by inv_norm_factor
    out = attend(query, key, value, attention_mask, causal=True, scale=self.inv_norm_factor,
                 dropout=dropout_p(self, "attention_dropout"), alibi_slopes=_slopes(self.num_heads).to(query.device))
    context = out.reshape(out.shape[0], out.shape[1], self.hidden_size)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * slices), int((i + 1) * slices)
            output = output + torch.nn.functional.linear(context[:, :, lo:hi], self.dense.weight[:, lo:hi])
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers (else the model uses the attention interface)."""
    from transformers.models.bloom import modeling_bloom as m

    return computes_attention_itself(m.BloomAttention)


def apply_hf_flash_to_bloom(model=None):
    if not applies():
        return 0
    from transformers.models.bloom import modeling_bloom as m

    if model is not None:
        return bind_all(model, m.BloomAttention, "forward", forward, model.config)
