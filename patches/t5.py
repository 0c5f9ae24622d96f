"""T5 and its kin (mT5, UMT5, Switch Transformers, Pop2Piano, LongT5): the learned relative position bias in the
kernels.

These models add a per-head bias, looked up by the bucket of each (query, key) distance, to the attention scores,
and pass it to the attention function as a dense ``position_bias`` ``(1, H, Sq, Sk)``. The bucket of a distance is
constant beyond ``relative_attention_max_distance`` (R), so the whole bias is a table of 2R + 1 values per head,
indexed by the key's position relative to the query clamped to [-R, R]: hf_flash's ``rel_bias``
(``flash_attn_func``), which the kernels read per element and differentiate (no S x S bias in memory).

The patch binds ``compute_bias`` on each attention module (this instance only): it returns that table, computed by
the module's own ``compute_bias`` at relative positions -R..R (its own bucket function and embedding, so the
bias and its gradient are the model's). The model passes it on to ``position_bias`` of the attention function
(and to the next layers, as T5 shares the first layer's bias), where ``hf_flash.integration`` reads a 2-D
``position_bias`` as a table. Modules without a relative bias (cross-attention, and T5's later layers when they
build one) pass T5's zeros ``(1, H, Sq, Sk)``: from a patched module, a 4-D ``position_bias`` is that zero bias
(``compute_bias`` never returns one), so it is dropped. Switch Transformers' encoder builds BERT's extended mask
itself: its modules get the 2-D padding mask. Parameter names and state-dict keys are unchanged.

LongT5's encoder computes its local attention in its own code (``LongT5LocalAttention``: each token sees the
tokens within ``local_radius``); it runs as one call with the window ``(local_radius, local_radius)`` and the same
table. Its transient-global encoder (global block summaries as extra keys) is refused.
"""

from __future__ import annotations

import torch

from ._common import attend, bind, dropout_p, padding_mask_from_extended

MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in
                ("t5", "mt5", "umt5", "switch_transformers", "pop2piano", "longt5"))
# Attention classes that pass position_bias to the attention interface and build it with compute_bias.
ATTENTION_CLASSES = ("T5Attention", "MT5Attention", "UMT5Attention", "SwitchTransformersAttention",
                     "Pop2PianoAttention", "LongT5Attention")
LOCAL_CLASS = "LongT5LocalAttention"
# Encoders that build BERT's extended (B, 1, 1, S) additive mask themselves: their modules get the 2-D padding mask.
EXTENDED_MASK_CLASSES = ("SwitchTransformersAttention",)
MARK = "_hf_flash_rel_bias"  # on patched modules: a 4-D position_bias they pass is T5's zero bias


def applies() -> bool:
    """T5's attention builds its bias with ``compute_bias(query_length, key_length, ..., past_seen_tokens)`` and
    calls the attention interface with it (transformers 5.17 and newer)."""
    import inspect

    from transformers.models.t5 import modeling_t5 as m

    compute_bias = getattr(m.T5Attention, "compute_bias", None)
    return compute_bias is not None and "past_seen_tokens" in inspect.signature(compute_bias).parameters


def unsupported(config):
    if getattr(config, "model_type", None) == "longt5" and getattr(config, "encoder_attention_type", "local") != "local":
        return ("its transient-global encoder attention adds per-block global summary tokens as extra keys, with "
                "their own bias, which one flash attention call cannot express (encoder_attention_type='local' runs)")
    return None


def table(module) -> torch.Tensor:
    """The module's relative position bias as a ``(H, 2R + 1)`` table, R = ``relative_attention_max_distance``:
    column R + d is the bias of a key d positions after its query."""
    r = module.relative_attention_max_distance
    return type(module).compute_bias(module, 1, 2 * r + 1, past_seen_tokens=r)[0, :, 0, :]


def _compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
    return table(self)


def _padding_mask_forward(self, hidden_states, mask=None, *args, **kwargs):
    return type(self).forward(self, hidden_states, padding_mask_from_extended(mask), *args, **kwargs)


def _bucket_table(module) -> torch.Tensor:
    """``table`` for LongT5's local attention, whose ``compute_bias`` takes a block length instead."""
    r = module.relative_attention_max_distance
    rel = torch.arange(-r, r + 1, device=module.relative_attention_bias.weight.device)
    buckets = module._relative_position_bucket(rel, bidirectional=not module.is_decoder,
                                               num_buckets=module.relative_attention_num_buckets, max_distance=r)
    return module.relative_attention_bias(buckets).T


def _local_forward(self, hidden_states, mask=None, position_bias=None, output_attentions=False):
    """LongT5's local encoder attention as one windowed call; returns (output, the table for the next layers)."""
    if output_attentions:
        from hf_flash.integration import UnsupportedAttentionError

        raise UnsupportedAttentionError("hf_flash never materialises attention weights; "
                                        "use attn_implementation='eager' with output_attentions=True")
    b, s = hidden_states.shape[:2]
    q, k, v = (proj(hidden_states).view(b, s, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
               for proj in (self.q, self.k, self.v))
    if position_bias is None and self.has_relative_attention_bias:
        position_bias = _bucket_table(self)
    padding = None
    if mask is not None:  # (B, 1, blocks, L, 3L): the middle block's diagonal is each token's own padding flag
        blocks = mask.shape[2]
        diag = torch.arange(self.block_len, device=mask.device)
        padding = mask[:, 0, :, diag, self.block_len + diag].reshape(b, blocks * self.block_len)[:, :s]
        padding = None if bool(padding.all()) else padding
    out = attend(q, k, v, padding, causal=False, scale=1.0, dropout=dropout_p(self, "dropout"),
                 window_left=self.local_radius, window_right=self.local_radius, rel_bias=position_bias)
    return self.o(out.reshape(b, s, -1)), position_bias


def apply_hf_flash_to_t5(model=None):
    if not applies() or model is None:
        return 0
    from transformers import PreTrainedModel

    # T5's stacks carry configs of their own (copies of the model's), and each attention module looks its attention
    # function up in its stack's: the patch follows the same config
    stacks = {p: m.config for p, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    n = 0
    for path, module in model.named_modules():
        name = type(module).__name__
        config = stacks[max((p for p in stacks if p == "" or path.startswith(p + ".")), key=len)]
        if name in ATTENTION_CLASSES and path.endswith("SelfAttention") and module.is_decoder:
            # transformers 5.17 builds UMT5's decoder self-attention with is_causal=False (eager is causal through its
            # 4-D mask; sdpa leaks future tokens there); the flash path reads is_causal
            module.is_causal = True
        if name in ATTENTION_CLASSES:
            bind(module, "compute_bias", _compute_bias, config)
            if name in EXTENDED_MASK_CLASSES:
                bind(module, "forward", _padding_mask_forward, config)
        elif name == LOCAL_CLASS:
            bind(module, "forward", _local_forward, config)
        else:
            continue
        setattr(module, MARK, True)
        n += 1
    return n
