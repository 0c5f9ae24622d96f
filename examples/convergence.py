"""Same-seed training with hf_flash and a reference backend: loss curves side by side.

    python examples/convergence.py --text-file .data/tinyshakespeare.txt --max-steps 300
    python examples/convergence.py --compare 1-gpu=single.json 2-gpu-ddp=ddp.json --out out/multi_gpu

Trains the small random-init byte-level Llama of finetune_trainer.py twice
from the same seed and data order, once per backend, logging every step; then
compares per-step losses (max and mean absolute difference over the run, and
the final-loss difference against --tolerance) and held-out perplexity on the
file's last 5%. Writes convergence.csv and convergence.png to --out. Exits 1
when the final losses or the perplexities differ by more than --tolerance
(relative; the default 2e-2 fits bf16 on GPU, where the two backends round
differently and trajectories drift apart slowly).

--compare skips training and compares loss logs written by
`finetune_trainer.py --loss-log` (e.g. one GPU against `accelerate launch` on
several): the first curve is the reference.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from finetune_trainer import ByteTokenizer, main as finetune, per_step_losses  # noqa: E402
from generate_perplexity import perplexity  # noqa: E402


def report(curves: dict[str, list[float]], ppl: dict[str, float], out: str, tolerance: float) -> int:
    """CSV, plot and verdict: every curve (and perplexity, where given) against the first one."""
    names = list(curves)
    ref_name, ref = names[0], curves[names[0]]
    steps = min(len(c) for c in curves.values())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "convergence.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *names])
        writer.writerows([i + 1, *(curves[n][i] for n in names)] for i in range(steps))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, style in zip(names, ("-", "--", ":", "-.")):
        label = f"{n} (held-out ppl {ppl[n]:.3f})" if n in ppl else n
        ax.plot(curves[n][:steps], label=label, lw=1, ls=style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    ax.set_title(f"same seed, byte-level Llama, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "convergence.png"), dpi=110)

    ok = True
    for n in names[1:]:
        diffs = [abs(a - b) for a, b in zip(curves[n][:steps], ref[:steps])]
        final_rel = abs(curves[n][steps - 1] - ref[steps - 1]) / ref[steps - 1]
        print(f"{n} vs {ref_name}: per-step loss |diff| max {max(diffs):.4f}, mean {sum(diffs) / steps:.4f} "
              f"over {steps} steps; final loss {curves[n][steps - 1]:.4f} vs {ref[steps - 1]:.4f} "
              f"(relative {final_rel:.2e})")
        ok &= final_rel <= tolerance
        if n in ppl and ref_name in ppl:
            ppl_rel = abs(ppl[n] - ppl[ref_name]) / ppl[ref_name]
            print(f"held-out perplexity: {n} {ppl[n]:.4f} vs {ref_name} {ppl[ref_name]:.4f} (relative {ppl_rel:.2e})")
            ok &= ppl_rel <= tolerance
    print(f"tolerance {tolerance:.0e} (relative)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file")
    src.add_argument("--compare", nargs="+", metavar="NAME=LOSS_LOG",
                     help="compare loss logs of finetune_trainer.py --loss-log instead of training")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--reference", default="sdpa")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--tolerance", type=float, default=2e-2)
    p.add_argument("--out", default="out/convergence")
    args = p.parse_args(argv)
    if args.compare:
        curves = {}
        for item in args.compare:
            name, _, path = item.partition("=")
            with open(path) as f:
                curves[name] = json.load(f)
        return report(curves, {}, args.out, args.tolerance)
    text = open(args.text_file, encoding="utf-8").read()
    split = int(len(text) * 0.95)
    os.makedirs(args.out, exist_ok=True)
    train_file = os.path.join(args.out, "train.txt")
    with open(train_file, "w", encoding="utf-8") as f:
        f.write(text[:split])
    held_out = torch.tensor(ByteTokenizer()([text[split:]])["input_ids"][0][:8192])

    curves, ppl = {}, {}
    for backend in ("hf_flash", args.reference):
        trainer = finetune(["--text-file", train_file, "--attn", backend, "--max-steps", str(args.max_steps),
                            "--logging-steps", "1", "--lr", "1e-3", "--max-length", "512",
                            "--output-dir", os.path.join(args.out, backend)] + (["--packing"] if args.packing else []))
        curves[backend] = per_step_losses(trainer)
        trainer.model.eval()
        ppl[backend] = perplexity(trainer.model, held_out, window=512, stride=256)

    return report(curves, ppl, args.out, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
