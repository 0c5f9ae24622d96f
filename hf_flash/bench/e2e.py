"""Whole models: training tokens/s and peak memory, generation tokens/s, for
hf_flash against sdpa, eager and flex_attention in the same run.

Model: the generation benchmark's (``hf_flash.bench.generate``: Llama-style random
init, 8 layers, hidden 2048, 16 query / 8 KV heads, bf16), trained with AdamW.
Training shapes: 2 x 4096, 1 x 16384 (attention dominates) and one packed row of
8192 tokens made of documents of random length (position ids restart per
document). Generation: that benchmark's 8 x 1024 + 128 case, dynamic cache.
Times: CUDA-synchronised wall clock, median of timed steps after warm-up steps; per case every
backend's model is resident and the timed steps take turns, so drift over the process falls on all.
Writes e2e.csv and e2e.png to --out and prints a table last.
"""

from __future__ import annotations

import gc
import os
import statistics

import torch

from . import generate
from .generate import Row, error_row, build_model, plot, summary, take_turns
from .kernels import write_csv

BACKENDS = ("hf_flash", "sdpa", "flex_attention", "eager")
TRAIN_SHAPES = {"2x4096": (2, 4096), "1x16384": (1, 16384), "packed-8192": (1, 8192)}
EAGER_MAX_TOKENS_PER_ROW = 4096  # eager materialises B*H*S^2 scores
GEN_SHAPE = "8x1024"
WARMUP_STEPS = 3


def add_arguments(parser) -> None:
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10,
                        help=f"timed training steps per backend, taking turns (after {WARMUP_STEPS} warm-up steps)")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--out", default="bench_out", help="directory for e2e.csv / e2e.png")


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


def _trainer(backend: str, shape: str, layers: int):
    """(step(), resident bytes) of one backend's benchmark model: step() is one AdamW training step on the
    shape's batch; resident = weights + optimizer state, what the model holds between steps."""
    batch = train_batch(shape)
    model = build_model(backend, layers, max_positions=16384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        # Fresh tensors each step, as a data loader gives: nothing a backend caches on its inputs carries over.
        model(**{name: t.clone() for name, t in batch.items()}).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    tensors = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values())]
    return step, sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.is_cuda)


def measure_train(backends: list[str], shape: str, layers: int, steps: int) -> list[Row]:
    """Every backend on one training shape, all models resident, the timed steps taking turns
    (``generate.take_turns``): a fixed order drifts with clocks over a process. Peak memory = the model's
    weights and optimizer state + the most its own step allocated on top of what was resident."""
    tokens = TRAIN_SHAPES[shape][0] * TRAIN_SHAPES[shape][1]
    ready, rows = {}, {}
    for backend in backends:
        try:
            step, resident = _trainer(backend, shape, layers)
            ready[backend] = {"run": step, "resident": resident}
        except Exception as e:  # noqa: BLE001  (a backend that cannot run the shape)
            rows[backend] = error_row("train", shape, backend, e)
    for backend, e in take_turns(ready, steps).items():
        rows[backend] = error_row("train", shape, backend, e)
    for backend, case in ready.items():
        rows[backend] = Row("train", shape, backend, tokens / statistics.median(case["times"]),
                            (case["resident"] + case["peak"]) / 2**30)
    ready = None
    gc.collect()
    torch.cuda.empty_cache()
    return [rows[b] for b in backends]


def run(args) -> None:
    from tqdm import tqdm

    import hf_flash  # noqa: F401  (registers the backend)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    jobs = [("train", shape) for shape in TRAIN_SHAPES]
    if not args.skip_generate:
        jobs.append(("generate-dynamic", GEN_SHAPE))
    rows = []
    for task, shape in tqdm(jobs, desc="e2e", unit="case"):  # each case: all backends, interleaved
        if task == "train":
            eligible = [b for b in backends if not (b == "eager" and TRAIN_SHAPES[shape][1] > EAGER_MAX_TOKENS_PER_ROW)]
            rows += measure_train(eligible, shape, args.layers, args.steps)
        else:
            rows += generate.measure_interleaved(backends, shape, args.layers)
    write_csv(rows, args.out, "e2e.csv")
    plot(rows, os.path.join(args.out, "e2e.png"))
    print(summary(rows))
