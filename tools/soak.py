"""Soak: one process, ``--minutes`` of mixed work through attn_implementation="hf_flash", memory watched.

    python tools/soak.py --minutes 8 --out soak

A small random-init Llama cycles through training steps (dense batches of changing shapes, padded batches,
packed batches from DataCollatorWithFlattening: position_ids restarts, or its flash-attention kwargs) and
generate() with the dynamic and the static cache. After every iteration (gradients freed, synchronised) it
records ``torch.cuda.memory_allocated()``; after the warm-up the trace must be flat: it fails on any error or on
growth above ``--tolerance-mb`` (last minus first, or the fitted slope over the run). Writes memory.csv and
memory.png to ``--out`` and prints a one-line summary last. The deadline counts from the start of ``main`` (after
importing torch): model building and every iteration fall inside ``--minutes``, only the last iteration (well
under a second on a GPU) and the plot past it. On CPU it runs a tiny model on the reference path and records
0 bytes (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import random
import sys
import time
from pathlib import Path

import torch

STEP_KINDS = ("dense", "padded", "packed", "packed_kwargs", "generate_dynamic", "generate_static")


def build_model(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_flash  # noqa: F401  (registers attn_implementation="hf_flash")

    small = device == "cuda"
    config = LlamaConfig(vocab_size=1024 if small else 128, hidden_size=256 if small else 64,
                         intermediate_size=512 if small else 128, num_hidden_layers=2 if small else 1,
                         num_attention_heads=4 if small else 2, num_key_value_heads=2 if small else 1,
                         head_dim=64 if small else 32, max_position_embeddings=4096, pad_token_id=0,
                         bos_token_id=1, eos_token_id=None, attn_implementation="hf_flash")
    torch.manual_seed(0)
    # bf16 weights on the GPU (the kernels' dtype): a static cache takes the model's dtype, so fp32 weights under
    # autocast would hand it bf16 keys to store in an fp32 buffer.
    model = LlamaForCausalLM(config).to(device, torch.bfloat16 if small else torch.float32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: always generate max_new_tokens
    return model


class Soak:
    def __init__(self, device: str, seed: int):
        self.device, self.rng = device, random.Random(seed)
        self.model = build_model(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.vocab = self.model.config.vocab_size
        gpu = device == "cuda"
        self.lengths = (17, 64, 127, 256, 511, 1024) if gpu else (5, 16, 33)
        self.batches = (1, 2, 4) if gpu else (1, 2)
        self.autocast = contextlib.nullcontext()  # the model already runs in the kernels' dtype

    def tokens(self, *shape):
        return torch.randint(2, self.vocab, shape, device=self.device)

    def train(self, batch: dict) -> None:
        self.model.train()
        with self.autocast:
            loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()}")

    def step(self, kind: str) -> str:
        b, s = self.rng.choice(self.batches), self.rng.choice(self.lengths)
        if kind == "dense":
            ids = self.tokens(b, s)
            self.train(dict(input_ids=ids, labels=ids))
        elif kind == "padded":
            b = max(b, 2)
            ids, mask = self.tokens(b, s), torch.ones(b, s, dtype=torch.long, device=self.device)
            for row in range(b):  # ragged rows, left or right padded
                pad = self.rng.randrange(s // 2 + 1)
                cols = slice(0, pad) if self.rng.random() < 0.5 else slice(s - pad, s)
                mask[row, cols] = 0
            labels = ids.masked_fill(mask == 0, -100)
            self.train(dict(input_ids=ids, attention_mask=mask, labels=labels))
        elif kind in ("packed", "packed_kwargs"):
            from transformers import DataCollatorWithFlattening

            collate = DataCollatorWithFlattening(return_flash_attn_kwargs=kind == "packed_kwargs")
            docs = [{"input_ids": self.tokens(self.rng.choice(self.lengths) // 2 + 1).tolist()}
                    for _ in range(self.rng.randint(2, 5))]
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in collate(docs).items()}
            s = batch["input_ids"].shape[1]
            self.train(batch)
        else:
            self.model.eval()
            ids, mask = self.tokens(b, s), torch.ones(b, s, dtype=torch.long, device=self.device)
            for row in range(1, b):  # left padding, as for batched generation
                mask[row, : self.rng.randrange(s // 2 + 1)] = 0
            new = self.rng.choice((4, 16, 33))
            static = kind == "generate_static"
            with torch.no_grad(), self.autocast:
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, cache_implementation="static" if static else None,
                                          disable_compile=True)
            if out.shape != (b, s + new):
                raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(b, s + new)}")
        return f"{kind} b={b} s={s}"


def allocated(device: str) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def slope(ys: list) -> float:
    """Least-squares slope per iteration."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def write_trace(out: Path, rows: list, warmup: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", "seconds", "step", "memory_allocated_bytes", "warmup"])
        for i, (t, step, mem) in enumerate(rows):
            writer.writerow([i, f"{t:.3f}", step, mem, int(i < warmup)])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak: matplotlib not installed, no memory.png", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([r[0] for r in rows], [r[2] / 2**20 for r in rows], lw=0.8)
    if warmup < len(rows):
        ax.axvline(rows[warmup][0], color="gray", ls="--", lw=0.8, label="end of warm-up")
        ax.legend()
    ax.set_xlabel("seconds")
    ax.set_ylabel("torch.cuda.memory_allocated() (MiB)")
    ax.set_title("hf_flash soak: memory after each iteration")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    start = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--out", type=Path, default=Path("soak"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=float, default=0.1,
                        help="fraction of the run not checked for growth (on a GPU, at least one round of steps)")
    parser.add_argument("--tolerance-mb", type=float, default=0.0, help="allowed growth after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    deadline = start + 60 * args.minutes
    rows, error = [], None
    try:
        soak = Soak(args.device, args.seed)
        i = 0
        while time.monotonic() < deadline:
            step = soak.step(STEP_KINDS[i % len(STEP_KINDS)])
            rows.append((time.monotonic() - start, step, allocated(args.device)))
            i += 1
    except Exception as e:  # reported in the summary, the trace so far kept
        error = f"{type(e).__name__}: {e} (iteration {len(rows)})"
        import traceback

        traceback.print_exc()
    warmup = next((i for i, r in enumerate(rows) if r[0] >= args.warmup * 60 * args.minutes), len(rows))
    if args.device == "cuda":  # at least one round of every kind of step (optimizer state, cuBLAS workspaces)
        warmup = min(max(warmup, len(STEP_KINDS)), len(rows))
    write_trace(args.out, rows, warmup)
    steady = [r[2] for r in rows[warmup:]]
    tol = args.tolerance_mb * 2**20
    growth = steady[-1] - steady[0] if steady else 0
    fitted = slope(steady) * max(len(steady) - 1, 0)
    ok = error is None and len(steady) >= 2 and growth <= tol and fitted <= tol
    if error is None and len(steady) < 2:
        error = f"too few iterations after the warm-up ({len(rows)} in all): give it more --minutes"
    mib = lambda x: f"{x / 2**20:.2f} MiB"
    summary = (f"soak {'PASS' if ok else 'FAIL'}: {len(rows)} iterations in {time.monotonic() - start:.1f} s on "
               f"{args.device} ({warmup} warm-up); memory_allocated first {mib(steady[0] if steady else 0)}, last "
               f"{mib(steady[-1] if steady else 0)}, max {mib(max(steady, default=0))}, growth {growth} B, slope "
               f"{slope(steady):.1f} B/iteration (fitted over the run {fitted:.0f} B); trace {args.out}/memory.csv"
               + (f"; error {error}" if error else ""))
    print(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
