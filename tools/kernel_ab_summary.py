"""The summary of tools/kernel_ab.sh's rounds: reads their CSV (TAG,case,backend,ms,tflops lines of
tools/kernel_ab.py, builds alternating), prints the table (median ms per case and build, new / each variant, the
same divided by each process's own cuDNN time, deterministic / default, cuDNN / new, the widest round-to-round
spread) and appends the rows in benchmarks/results.csv's columns to AB_ROWS if set (bench "kernel_ab <AB_PASS>",
commit = the build's label from AB_LABELS).

    AB_PASS=bwd AB_ROWS=rows.csv AB_LABELS="new=abc1234 base=def5678" python tools/kernel_ab_summary.py ab_bwd.csv base

The device copy runs it (kernel_ab.sh). To record a run whose CSV came back here, run it here with AB_ROWS=
benchmarks/results.csv and the device's environment, which this machine does not have, named: --date ISO --gpu
NAME --torch VERSION --cuda VERSION --cudnn VERSION (each column left to this machine's value where not given).
"""
import argparse
import collections
import os
import statistics

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("csv", help="the rounds' CSV (kernel_ab.sh: $OUT/ab_<pass>.csv)")
parser.add_argument("variants", nargs="*", help="the builds besides new, in kernel_ab.sh's VARIANTS order")
for column in ("date", "gpu", "torch", "cuda", "cudnn"):
    parser.add_argument(f"--{column}", help=f"the rows' {column} column (default: this machine's)")
args = parser.parse_args()

# (case, build, backend) -> its times in process order; each process times cuDNN after its build's case
own = collections.defaultdict(list)
for line in open(args.csv):
    tag, case, backend, ms, _ = line.strip().split(",")
    own[(case, tag, backend)].append(float(ms))
t = collections.defaultdict(list)  # (case, column): a build, "<build> det" or cudnn (every process's)
for (case, tag, backend), times in own.items():
    t[(case, {"hf_flash": tag, "det": tag + " det"}.get(backend, backend))] += times
builds = ["new", *args.variants]
dets = [x + " det" for x in builds if any(k[1] == x + " det" for k in t)]
med = lambda case, x: statistics.median(t[(case, x)])
cols = builds + dets + ["cudnn"]
def normed(case, x):  # median over rounds of (x / its cuDNN) / (new / its cuDNN)
    r = [(a / ca) / (n / cn) for a, ca, n, cn in zip(own[(case, x, "hf_flash")], own[(case, x, "cudnn")],
                                                       own[(case, "new", "hf_flash")], own[(case, "new", "cudnn")])]
    return statistics.median(r) if r else float("nan")
print(f"{'case':18} " + " ".join(f"{x:>9}" for x in cols) + " "
      + " ".join(f"{'new/' + x:>9}" for x in builds[1:]) + " " + " ".join(f"{'÷cuDNN':>9}" for x in builds[1:])
      + " " + " ".join(f"{x + '/':>10}" for x in dets) + "  cudnn/new  spread")
nan = float("nan")
for case in dict.fromkeys(c for c, _ in t):
    # a column a case has no time for (a deterministic run the case refuses, e.g. the bias's): NaN
    ms = {x: med(case, x) if t.get((case, x)) else nan for x in cols}
    spread = max((max(t[(case, x)]) - min(t[(case, x)])) / ms[x] for x in cols if t.get((case, x)))
    print(f"{case:18} " + " ".join(f"{ms[x]:9.3f}" for x in cols) + " "
          + " ".join(f"{ms[x] / ms['new']:9.3f}" for x in builds[1:]) + " "
          + " ".join(f"{normed(case, x):9.3f}" for x in builds[1:]) + " "
          + " ".join(f"{ms[x[:-4]] / ms[x]:10.3f}" for x in dets) + f"  {ms['cudnn'] / ms['new']:9.3f}  {spread:5.1%}")
if not os.environ.get("AB_ROWS"):  # the table only
    raise SystemExit(0)
from hf_flash.bench import results
labels = dict(x.split("=", 1) for x in os.environ.get("AB_LABELS", "").split())
env = results.environment()
env.update({k: getattr(args, k) for k in ("date", "gpu", "torch", "cuda", "cudnn") if getattr(args, k)})
for tag in builds:
    rows = []
    for (case, t_, backend), times in own.items():
        if t_ == tag:
            m = statistics.median(times)
            rows.append(results.Result(case, {"det": "hf_flash det"}.get(backend, backend), "ms", m, "ms",
                                       max(times) - min(times)))
    bench = results.bench_label(f"kernel_ab {os.environ['AB_PASS']}", float(os.environ.get("AB_SUSTAIN") or 0))
    results.append(rows, bench, os.environ["AB_ROWS"], {**env, "commit": labels.get(tag, tag)})
