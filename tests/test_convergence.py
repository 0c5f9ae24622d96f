"""Convergence (Liger-style): a mini Llama fine-tuned with transformers.Trainer on
tiny-shakespeare gives the same run with hf_flash as with sdpa (CPU, fp32).

Data are the play's speeches (blocks between blank lines), byte-level
tokenized, so batches have different lengths: the padded runs exercise
unpadding, the packed run (DataCollatorWithFlattening) the position_ids path.
A padded batch and the same batch packed predict exactly the same tokens, so
the packed hf_flash run must reproduce the padded sdpa baseline step by step.
"""

from __future__ import annotations

import math
import os
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import hf_flash  # noqa: E402,F401  (registers "hf_flash")

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from finetune_trainer import pad_collator  # noqa: E402

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[2] / "shared/data/tinyshakespeare.txt"
PAD, MAX_LEN, TRAIN, HELD_OUT = 0, 96, 256, 32  # bytes; NUL never occurs in the text
STEPS, BATCH, SEED = 32, 8, 42
PROMPT = b"ROMEO:\n"
# Measured over STEPS steps (fp32, this config): per-step |loss diff| <= 5e-6, final params <= 3.3e-5,
# held-out perplexity rel. diff <= 5e-7. Bounds leave 6-20x headroom for other CPUs / BLAS builds.
LOSS_TOL = dict(atol=1e-4, rtol=1e-4)
PARAM_TOL = dict(atol=2e-4, rtol=1e-3)
PPL_RTOL = 1e-4


@lru_cache(maxsize=None)
def speeches() -> tuple[list[int], ...]:
    if not DATA.is_file():
        pytest.skip(f"{DATA} not found (shared data checkout missing)")
    blocks = DATA.read_text(encoding="utf-8").split("\n\n")[: TRAIN + HELD_OUT]
    return tuple(list(b.encode("utf-8")[:MAX_LEN]) for b in blocks)


pad_collate = pad_collator(PAD)  # right padding, labels -100 on pads: the example's collator

COLLATORS = {"padded": pad_collate, "packed": transformers.DataCollatorWithFlattening()}


class LossRecorder(transformers.Trainer):
    """Keeps every training step's loss unrounded (the Trainer's log rounds to 4 digits)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training:
            self.step_losses.append(loss.item() if torch.is_tensor(loss) else loss[0].item())
        return loss


def mini_llama(impl: str):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(SEED)  # Liger: seed right before init
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl)


def train(impl: str, collator: str, output_dir: str):
    model = mini_llama(impl)
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=2e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=SEED, data_seed=SEED,
        dataloader_num_workers=0, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        disable_tqdm=True)
    trainer = LossRecorder(model=model, args=args, train_dataset=[{"input_ids": s} for s in speeches()[:TRAIN]],
                           data_collator=COLLATORS[collator])
    trainer.step_losses = []
    trainer.train()
    return model.eval(), trainer.step_losses


def perplexity(model) -> float:
    """exp(mean token NLL) over the held-out speeches, one padded batch."""
    batch = pad_collate([{"input_ids": s} for s in speeches()[TRAIN:]])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                            ignore_index=-100)
    return math.exp(nll.item())


def greedy(model) -> list[int]:
    ids = torch.tensor([list(PROMPT)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                             pad_token_id=PAD)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return train("sdpa", "padded", str(tmp_path_factory.mktemp("sdpa")))


@pytest.mark.parametrize("collator", list(COLLATORS))
def test_trainer_run_matches_sdpa(collator, baseline, tmp_path, kernel_calls):
    ref_model, ref_losses = baseline
    model, losses = train("hf_flash", collator, str(tmp_path))
    assert kernel_calls["bwd"] == STEPS * model.config.num_hidden_layers  # every backward ran through hf_flash

    assert len(losses) == len(ref_losses) == STEPS
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    print(f"\n{collator}: max per-step |loss diff| {max(diffs):.2e}; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < losses[0] - 1.0, "the run did not learn: the comparison would be vacuous"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOL)

    ref_params = dict(ref_model.named_parameters())
    param_diff = max((p - ref_params[n]).abs().max().item() for n, p in model.named_parameters())
    print(f"{collator}: max final |param diff| {param_diff:.2e}")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[n], **PARAM_TOL, msg=lambda m, n=n: f"{n}: {m}")

    ppl, ref_ppl = perplexity(model), perplexity(ref_model)
    print(f"{collator}: held-out perplexity hf_flash {ppl:.6f} vs sdpa {ref_ppl:.6f}")
    assert ppl < 0.5 * 256, "perplexity no better than chance"
    assert ppl == pytest.approx(ref_ppl, rel=PPL_RTOL)

    tokens, ref_tokens = greedy(model), greedy(ref_model)
    assert tokens == ref_tokens, f"{bytes(tokens)!r} vs {bytes(ref_tokens)!r}"
