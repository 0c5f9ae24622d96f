"""NLLB-MoE: causality and router padding taken from the 4-D eager mask.

* The decoder's self-attention modules are built with ``is_causal=False``:
  eager and sdpa get causality from the 4-D mask, flash attention from the
  module, so the decoder would see future tokens. The patch marks them causal
  (an attribute that eager ignores).
* The sparse layers hand the attention mask to the router as its padding mask
  and read it as an additive 4-D float mask (non-zero = padding, last query
  row). The flash mask is 2-D ``(batch, seq)`` with 1 = token: the router gets
  the same padding as eager's, flattened to one entry per token.
"""

from __future__ import annotations

from ._common import bind_all

MODULE = "transformers.models.nllb_moe.modeling_nllb_moe"


def sparse_mlp_forward(self, hidden_states, padding_mask=None):
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeSparseMLP

    if padding_mask is not None and padding_mask.dim() == 2:
        padding_mask = ~padding_mask.bool().flatten()
    return NllbMoeSparseMLP.forward(self, hidden_states, padding_mask)


def applies() -> bool:
    """The code this patch replaces is in the loaded transformers: the router taking the attention mask."""
    import inspect

    from transformers.models.nllb_moe import modeling_nllb_moe as m

    return "padding_mask" in inspect.signature(m.NllbMoeSparseMLP.forward).parameters


def apply_hf_flash_to_nllb_moe(model=None):
    if not applies():
        return 0
    from transformers.models.nllb_moe import modeling_nllb_moe as m

    if model is not None:
        for module in model.modules():
            if isinstance(module, m.NllbMoeDecoderLayer):
                module.self_attn.is_causal = True
        return bind_all(model, m.NllbMoeSparseMLP, "forward", sparse_mlp_forward, model.config)
