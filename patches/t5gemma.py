"""T5Gemma: the encoder's bidirectional sliding window, counted as flash attention counts it.

The eager mask lets a query see keys with ``|q - k| <= sliding_window``;
transformers' flash wrapper turns ``sliding_window=w`` into the window
``(w - 1, w - 1)``, one key short on each side (ModernBERT passes ``w + 1``
for that reason, T5Gemma passes ``w``). The encoder's sliding layers get
``w + 1``, an attribute that only flash paths read (eager and sdpa take the
window from the mask).
"""

from __future__ import annotations

MODULE = "transformers.models.t5gemma.modeling_t5gemma"
_WIDENED = "_hf_flash_window_widened"


def applies() -> bool:
    """The module whose window this patch widens is in the loaded transformers."""
    from transformers.models.t5gemma import modeling_t5gemma as m

    return hasattr(m, "T5GemmaSelfAttention")


def apply_hf_flash_to_t5gemma(model=None):
    if not applies():
        return 0
    from transformers.models.t5gemma import modeling_t5gemma as m

    n = 0
    for module in model.modules() if model is not None else ():
        if (isinstance(module, m.T5GemmaSelfAttention) and not module.is_causal and module.sliding_window
                and not getattr(module, _WIDENED, False)):
            module.sliding_window += 1
            setattr(module, _WIDENED, True)
            n += 1
    return n
