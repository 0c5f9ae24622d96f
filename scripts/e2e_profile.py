"""Where a training step's GPU time goes, hf_flash next to sdpa (device only).

    python scripts/e2e_profile.py [--shape 2x4096] [--backends hf_flash,sdpa]

Same model and batch as ``python -m hf_flash.bench e2e``; 3 warm-up steps, then
the profiler over 3 steps: total CUDA time per step and the top kernels.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import hf_flash  # noqa: F401  (registers the backend)
from hf_flash.bench.e2e import TRAIN_SHAPES, build_model, train_batch

p = argparse.ArgumentParser()
p.add_argument("--shape", default="2x4096", choices=list(TRAIN_SHAPES))
p.add_argument("--backends", default="hf_flash,sdpa")
p.add_argument("--rows", type=int, default=14)
args = p.parse_args()


def training_step(backend: str):
    model = build_model(backend, 8, max_positions=16384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batch = train_batch(args.shape)

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


for backend in args.backends.split(","):
    step = training_step(backend)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total_ms = sum(e.self_device_time_total for e in events) / 1e3 / 3
    print(f"\n== {backend} {args.shape}: {total_ms:.2f} ms CUDA time per step")
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    del step
    torch.cuda.empty_cache()
