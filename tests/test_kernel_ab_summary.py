"""tools/kernel_ab_summary.py: the A/B table's ratios and the rows it records, from a CSV of alternating rounds
(fresh random times each run)."""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_summary_ratios_and_rows(tmp_path):
    rng = random.Random()
    new_ms, cudnn_ms = rng.uniform(1, 2), rng.uniform(1, 2)
    base_ms = new_ms * rng.uniform(1.2, 1.5)  # apart enough that new / base swapped would fail
    lines = []
    for _ in range(3):  # rounds: new's process, then base's, each timing cuDNN after its case
        for tag, ms in (("new", new_ms), ("base", base_ms)):
            lines.append(f"{tag},case a,hf_flash,{ms * rng.uniform(0.99, 1.01)},0")
            lines.append(f"{tag},case a,det,{2 * ms},0")
            lines.append(f"{tag},case a,cudnn,{cudnn_ms},0")
    ab = tmp_path / "ab_bwd.csv"
    ab.write_text("\n".join(lines) + "\n")
    rows = tmp_path / "rows.csv"
    env = {**os.environ, "AB_PASS": "bwd", "AB_ROWS": str(rows), "AB_LABELS": "new=abc1234 base=def5678",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "tools/kernel_ab_summary.py", str(ab), "base", "--gpu", "Some GPU",
                          "--date", "2026-01-01"], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    cells = out.splitlines()[1].split()
    # "case a" (two fields), new, base, new det, base det, cudnn, new/base, ÷cuDNN, new det/, base det/, ...
    ratio, det_ratio = float(cells[7]), float(cells[9])
    assert abs(ratio - base_ms / new_ms) < 0.03 * base_ms / new_ms
    assert abs(det_ratio - 0.5) < 0.01  # default times drawn within 1%
    recorded = list(csv.DictReader(rows.open()))
    assert {r["commit"] for r in recorded} == {"abc1234", "def5678"}
    assert {r["gpu"] for r in recorded} == {"Some GPU"} and {r["date"] for r in recorded} == {"2026-01-01"}
    det = [r for r in recorded if r["commit"] == "def5678" and r["backend"] == "hf_flash det"]
    assert len(det) == 1 and abs(float(det[0]["value"]) - 2 * base_ms) < 1e-3
