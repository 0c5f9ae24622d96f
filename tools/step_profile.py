"""Where a training step's or a generate call's time goes, hf_flash next to sdpa (device only).

    python tools/step_profile.py [--shape 2x4096] [--backends hf_flash,sdpa]
    python tools/step_profile.py --generate 1x16384 [--new-tokens 16]

Same model and inputs as ``python -m hf_flash.bench e2e`` / ``generate`` (dynamic
cache); 3 warm-up runs, then the profiler over 3: wall and CUDA time per run and
the top CUDA kernels (generate, being host-bound, also gets the top CPU ops).
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hf_flash  # noqa: F401  (registers the backend)
from hf_flash.bench import generate
from hf_flash.bench.e2e import TRAIN_SHAPES, build_model, train_batch

p = argparse.ArgumentParser()
p.add_argument("--shape", default="2x4096", choices=list(TRAIN_SHAPES))
p.add_argument("--generate", choices=list(generate.SHAPES), help="profile generate() on this shape instead")
p.add_argument("--new-tokens", type=int, default=16)
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


def generate_call(backend: str):
    batch, length = generate.SHAPES[args.generate]
    model = build_model(backend, 8, max_positions=length + args.new_tokens).eval()
    ids, mask = generate.prompts(batch, length)

    @torch.no_grad()
    def step():
        model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       do_sample=False, pad_token_id=0)

    return step


activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.generate else [])
for backend in args.backends.split(","):
    step = generate_call(backend) if args.generate else training_step(backend)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / 3
    events = prof.key_averages()
    cuda_ms = sum(e.self_device_time_total for e in events) / 1e3 / 3
    print(f"\n== {backend} {args.generate or args.shape}: {wall_ms:.2f} ms wall (profiled), {cuda_ms:.2f} ms CUDA per run")
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.generate:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    del step
    torch.cuda.empty_cache()
