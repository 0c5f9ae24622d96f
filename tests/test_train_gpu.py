"""Fine-tune check on the GPU: a tiny random-init Llama trained for 30 steps with
attn_implementation="hf_flash" tracks "sdpa" from the same seed.

Text: helpers.SHAKESPEARE; skipped when missing.
Tolerance: bf16 weights and activations drift apart step by step through
rounding alone, so per-step losses must agree within 2% relative (loss ~ 4-6).
"""


import pytest
import torch

import hf_flash  # noqa: F401  (registers "hf_flash" with transformers)
from helpers import SHAKESPEARE

pytestmark = pytest.mark.gpu


STEPS, BATCH, SEQ = 30, 4, 256


def _batches():
    data = torch.tensor(list(SHAKESPEARE.read_bytes()[: STEPS * BATCH * (SEQ + 1)]), dtype=torch.long)
    return data.view(STEPS, BATCH, SEQ + 1).cuda()  # byte-level tokens, no tokenizer needed


def _train(impl):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation=impl).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in _batches():
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


def test_llama_finetune_tracks_sdpa():
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} missing (copy a slice of tinyshakespeare.txt there)")
    ref, ours = _train("sdpa"), _train("hf_flash")
    assert torch.isfinite(ours).all()
    assert ours[-1] < ours[0] - 0.5, f"no learning: {ours.tolist()}"
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=0.0, msg=lambda m: f"{m}\nhf_flash {ours}\nsdpa {ref}")
