"""``python -m hf_flash demo``: the whole product path on an embedded task.

A small Llama (GQA) learns to repeat digit strings written as text ("4172=4172;"),
a task that needs attention to look back to the right place
with ``Trainer`` and ``attn_implementation="hf_flash"``, on padded batches of
variable length (so the padding-mask path is exercised). It then generates
answers with a KV cache and checks that held-out perplexity matches ``sdpa``
on the same weights. Data is made here: nothing is downloaded.
Runs on CPU in a few minutes (reference path) and on a GPU in seconds (kernels).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch

VOCAB = "0123456789=;"  # id 0 is padding, characters start at 1
PAD = 0


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) + 1 for c in text]


def decode(ids) -> str:
    return "".join(VOCAB[i - 1] for i in ids if 0 < i <= len(VOCAB))


def make_examples(n: int, rng: random.Random) -> list[str]:
    """Several copies per example, of varying count, so lengths (and padding) vary."""
    def one():
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        return f"{digits}={digits};"

    return ["".join(one() for _ in range(rng.randint(2, 8))) for _ in range(n)]


class Examples(torch.utils.data.Dataset):
    def __init__(self, texts):
        self.ids = [encode(t) for t in texts]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def collate(batch, padding_side="right"):
    """Pad to the longest example; labels ignore padding."""
    width = max(len(x["input_ids"]) for x in batch)
    ids = torch.full((len(batch), width), PAD)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, x in enumerate(batch):
        n = len(x["input_ids"])
        cols = slice(0, n) if padding_side == "right" else slice(width - n, width)
        ids[row, cols] = torch.tensor(x["input_ids"])
        mask[row, cols] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_model(attn_implementation: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(VOCAB) + 1, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=PAD, bos_token_id=None, eos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)


@torch.no_grad()
def perplexity(model, texts, device) -> float:
    model.eval()
    batch = collate([{"input_ids": encode(t)} for t in texts])
    batch = {k: v.to(device) for k, v in batch.items()}
    return math.exp(model(**batch).loss.float().item())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_flash demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max relative perplexity difference to sdpa (default 1e-4 fp32, 2e-2 bf16)")
    parser.add_argument("--output-dir", default=None, help="Trainer output dir (default: a temporary dir)")
    args = parser.parse_args(argv)

    import tempfile

    import hf_flash
    from transformers import Trainer, TrainingArguments

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tolerance = args.tolerance or (2e-2 if dtype == torch.bfloat16 else 1e-4)
    print(hf_flash.env_report(), end="\n\n")

    rng = random.Random(args.seed)
    train, held_out = make_examples(4000, rng), make_examples(16, rng)
    model = build_model("hf_flash", dtype, args.seed).to(device)
    print(f"model: Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"attn_implementation={model.config._attn_implementation!r}, {dtype}, {device}")

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=args.steps // 10, weight_decay=0.0,
            logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[], seed=args.seed,
            bf16=dtype == torch.bfloat16, use_cpu=device == "cpu", dataloader_num_workers=0,
            disable_tqdm=False)
        start = time.perf_counter()
        result = Trainer(model=model, args=training_args, train_dataset=Examples(train), data_collator=collate).train()
        elapsed = time.perf_counter() - start
    print(f"\ntrained {args.steps} steps in {elapsed:.1f}s, final train loss {result.training_loss:.3f}")

    model.eval()
    prompts = ["1234=", "98765=", "500=", "272829="]
    batch = collate([{"input_ids": encode(p)} for p in prompts], padding_side="left")
    generated = model.generate(input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device),
                               max_new_tokens=7, do_sample=False, pad_token_id=PAD)
    correct = 0
    for prompt, ids in zip(prompts, generated[:, batch["input_ids"].shape[1]:].tolist()):
        answer, expected = decode(ids).split(";")[0], prompt[:-1]
        correct += answer == expected
        print(f"  {prompt}{answer:<7} {'ok' if answer == expected else f'(expected {expected})'}")
    print(f"generation: {correct}/{len(prompts)} repeated right (greedy, left-padded, KV cache)")

    ppl_ours = perplexity(model, held_out, device)
    model.set_attn_implementation("sdpa")
    ppl_sdpa = perplexity(model, held_out, device)
    rel = abs(ppl_ours - ppl_sdpa) / ppl_sdpa
    verdict = "PASS" if rel <= tolerance else "FAIL"
    print(f"held-out perplexity: hf_flash {ppl_ours:.4f}  sdpa {ppl_sdpa:.4f}  "
          f"relative difference {rel:.2e} (tolerance {tolerance:.0e}): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
