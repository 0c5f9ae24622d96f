"""Same-seed training with hf_flash and a reference backend: loss curves side by side.

    python examples/convergence.py --text-file ../shared/data/tinyshakespeare.txt --max-steps 300

Trains the small random-init byte-level Llama of finetune_trainer.py twice
from the same seed and data order, once per backend, logging every step; then
compares per-step losses (max and mean absolute difference over the run, and
the final-loss difference against --tolerance) and held-out perplexity on the
file's last 5%. Writes convergence.csv and convergence.png to --out. Exits 1
when the final losses or the perplexities differ by more than --tolerance
(relative; the default 2e-2 fits bf16 on GPU, where the two backends round
differently and trajectories drift apart slowly).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from finetune_trainer import ByteTokenizer, main as finetune  # noqa: E402
from generate_perplexity import perplexity  # noqa: E402


def per_step_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-file", required=True)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--reference", default="sdpa")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--tolerance", type=float, default=2e-2)
    p.add_argument("--out", default="out/convergence")
    args = p.parse_args(argv)
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

    ours, ref = curves["hf_flash"], curves[args.reference]
    diffs = [abs(a - b) for a, b in zip(ours, ref)]
    with open(os.path.join(args.out, "convergence.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "hf_flash", args.reference])
        writer.writerows(zip(range(1, len(ours) + 1), ours, ref))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ours, label=f"hf_flash (held-out ppl {ppl['hf_flash']:.3f})", lw=1)
    ax.plot(ref, label=f"{args.reference} (held-out ppl {ppl[args.reference]:.3f})", lw=1, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    ax.set_title(f"same seed, byte-level Llama, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "convergence.png"), dpi=110)

    final_rel = abs(ours[-1] - ref[-1]) / ref[-1]
    ppl_rel = abs(ppl["hf_flash"] - ppl[args.reference]) / ppl[args.reference]
    print(f"per-step loss |diff|: max {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f} over {len(diffs)} steps")
    print(f"final loss: hf_flash {ours[-1]:.4f} vs {args.reference} {ref[-1]:.4f} (relative {final_rel:.2e})")
    print(f"held-out perplexity: hf_flash {ppl['hf_flash']:.4f} vs {args.reference} {ppl[args.reference]:.4f} "
          f"(relative {ppl_rel:.2e}); tolerance {args.tolerance:.0e}")
    ok = final_rel <= args.tolerance and ppl_rel <= args.tolerance
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
