"""Whole models: training tokens/s and peak memory, generation tokens/s, for
hf_flash against sdpa, eager and flex_attention in the same run.

Model: Llama-style random init, 8 layers, hidden 2048, 16 query / 8 KV heads
(d 128), intermediate 5632, vocab 32000, bf16, AdamW. Training shapes: 2 x 4096,
1 x 16384 (attention dominates) and one packed row of 8192 tokens made of
documents of random length (position ids restart per document). Generation:
8 x 1024-token prompts (left-padded) + 128 new greedy tokens, dynamic cache.
Times: CUDA-synchronised wall clock over timed steps after warm-up steps.
Writes e2e.csv and e2e.png to --out and prints a table last.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .kernels import write_csv

BACKENDS = ("hf_flash", "sdpa", "flex_attention", "eager")
TRAIN_SHAPES = {"2x4096": (2, 4096), "1x16384": (1, 16384), "packed-8192": (1, 8192)}
EAGER_MAX_TOKENS_PER_ROW = 4096  # eager materialises B*H*S^2 scores
GEN_BATCH, GEN_PROMPT, GEN_NEW = 8, 1024, 128


@dataclass
class Row:
    task: str
    shape: str
    backend: str
    tokens_per_s: float
    peak_gib: float
    error: str = ""


def add_arguments(parser) -> None:
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (after 3 warm-up steps)")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--out", default="bench_out", help="directory for e2e.csv / e2e.png")


def build_model(backend: str, layers: int, max_positions: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=backend, dtype=torch.bfloat16)


def train_batch(shape: str):
    batch, seqlen = TRAIN_SHAPES[shape]
    ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")
    if not shape.startswith("packed"):
        return {"input_ids": ids, "labels": ids}
    gen = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seqlen:
        n = min(int(torch.randint(128, 2048, (1,), generator=gen)), seqlen - total)
        lengths.append(n)
        total += n
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    return {"input_ids": ids, "labels": ids, "position_ids": position_ids}


def _timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure_train(backend: str, shape: str, layers: int, steps: int) -> Row:
    batch = train_batch(shape)
    model = build_model(backend, layers, max_positions=16384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    seconds = _timed(step, warmup=3, steps=steps)
    return Row("train", shape, backend, batch["input_ids"].numel() / seconds, torch.cuda.max_memory_allocated() / 2**30)


@torch.no_grad()
def measure_generate(backend: str, layers: int) -> Row:
    model = build_model(backend, layers, max_positions=4096).eval()
    ids = torch.randint(0, 32000, (GEN_BATCH, GEN_PROMPT), device="cuda")
    mask = torch.ones_like(ids)
    for row in range(GEN_BATCH):  # left padding of 0..7*16 tokens
        mask[row, : 16 * row] = 0

    def generate():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=GEN_NEW, min_new_tokens=GEN_NEW,
                       do_sample=False, pad_token_id=0)

    torch.cuda.reset_peak_memory_stats()
    seconds = _timed(generate, warmup=1, steps=2)
    return Row("generate", f"{GEN_BATCH}x{GEN_PROMPT}+{GEN_NEW}", backend, GEN_BATCH * GEN_NEW / seconds,
               torch.cuda.max_memory_allocated() / 2**30)


def _safely(measure, task, shape, backend, *args) -> Row:
    try:
        return measure(backend, *args)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # a backend that cannot run the shape
        return Row(task, shape, backend, float("nan"), float("nan"), str(e).splitlines()[0][:120])
    finally:
        torch.cuda.empty_cache()


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r.task, r.shape) for r in rows))
    backends = list(dict.fromkeys(r.backend for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(3.4 * len(groups), 6.5), squeeze=False)
    for col, (task, shape) in enumerate(groups):
        for row, (field, label) in enumerate((("tokens_per_s", "tokens/s"), ("peak_gib", "peak GiB"))):
            values = [next((getattr(r, field) for r in rows if (r.task, r.shape, r.backend) == (task, shape, b)),
                           float("nan")) for b in backends]
            ax = axes[row][col]
            ax.bar(backends, values, color=["C0" if b == "hf_flash" else "C7" for b in backends])
            ax.set_title(f"{task} {shape}", fontsize=9)
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"{torch.cuda.get_device_name()}: Llama 8x2048, 16/8 heads, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(rows: list[Row]) -> str:
    lines = [f"{'task':9} {'shape':16} {'backend':15} {'tok/s':>10} {'peak GiB':>9} {'vs sdpa':>8}"]
    sdpa = {(r.task, r.shape): r.tokens_per_s for r in rows if r.backend == "sdpa"}
    for r in rows:
        base = sdpa.get((r.task, r.shape))
        ratio = f"{r.tokens_per_s / base:8.2f}" if base and r.tokens_per_s == r.tokens_per_s else f"{'-':>8}"
        lines.append(f"{r.task:9} {r.shape:16} {r.backend:15} {r.tokens_per_s:10.0f} {r.peak_gib:9.1f} {ratio}"
                     + (f"  ({r.error})" if r.error else ""))
    return "\n".join(lines)


def run(args) -> None:
    from tqdm import tqdm

    import hf_flash  # noqa: F401  (registers the backend)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    jobs = [("train", shape, b) for shape in TRAIN_SHAPES for b in backends
            if not (b == "eager" and TRAIN_SHAPES[shape][1] > EAGER_MAX_TOKENS_PER_ROW)]
    if not args.skip_generate:
        jobs += [("generate", f"{GEN_BATCH}x{GEN_PROMPT}+{GEN_NEW}", b) for b in backends]
    rows = []
    for task, shape, backend in tqdm(jobs, desc="e2e", unit="case"):
        if task == "train":
            rows.append(_safely(measure_train, task, shape, backend, shape, args.layers, args.steps))
        else:
            rows.append(_safely(measure_generate, task, shape, backend, args.layers))
    write_csv(rows, args.out, "e2e.csv")
    plot(rows, os.path.join(args.out, "e2e.png"))
    print(summary(rows))
