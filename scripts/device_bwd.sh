#!/bin/bash
# One device call for the backward kernels. Usage on the device (all steps optional by env):
#   TESTS=1 VTESTS="v ..." SAN=1 SASS=1 VARIANTS="v ..." SEQLENS=2048,8192 NCU="d:S:causal[:v] ..." BENCH=1 \
#     bash scripts/device_bwd.sh [pytest -k expr]
# Builds sm90a only (build time). For kernel A/B runs, csrc/bwd/launch.cuh gets a temporary switch on the
# environment variable HF_FLASH_BWD_VARIANT (none at present): VTESTS reruns the d64/d128 gradient tests per
# variant; VARIANTS runs bench_bwd.py per variant (variant 0 with the deterministic rows, each next to
# SDPA-flash in the same run) into $OUT/variants.csv and prints a ratio table, variants side by side, last.
# BENCH=1 runs the default table into $OUT/bench_bwd.csv.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=90a MAX_JOBS=16 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# pyproject installs top-level patches/ as hf_flash.patches; mirror that for the uninstalled checkout.
[ -e hf_flash/patches ] || ln -s ../patches hf_flash/patches
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/log"
start=$(date +%s)
if ! python3 -m hf_flash build >"$OUT/build.log" 2>&1; then
  echo "full build failed, building without the forward" | tee -a "$OUT/log"
  export HF_FLASH_DISABLE_FORWARD=1  # at run time too: it is part of the build's cache key
  python3 -m hf_flash build >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build $(( $(date +%s) - start )) s" | tee -a "$OUT/log"
so=$(tail -1 "$OUT/build.log")  # python -m hf_flash build prints the library's path last
if [ "${SASS:-0}" = 1 ]; then
  cuobjdump -res-usage "$so" 2>/dev/null | grep -A1 "main_kernel" | grep -oE "Function [^ ]+|REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+|LOCAL:[0-9]+" | paste - - - - - >"$OUT/sass.txt"
  for f in $(cuobjdump -sass "$so" | grep -oE "Function : \S*main_kernel\S*" | awk '{print $3}'); do
    echo "== $f" >>"$OUT/sass.txt"
    cuobjdump -sass -fun "$f" "$so" | grep -oE "(RED|ATOM|BAR|LDSM|HMMA|STS|LDS|LDL|STL|MUFU|LDGSTS|SHFL)[.A-Z0-9_]*" | sort | uniq -c >>"$OUT/sass.txt"
  done
  echo "sass done" | tee -a "$OUT/log"
fi
if [ "${TESTS:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q --tb=line -rfs --no-header -p no:cacheprovider tests/test_kernels_bwd.py tests/test_train_gpu.py \
    ${1:+-k "$1"} 2>&1 | tail -25 | tee -a "$OUT/log"
fi
if [ "${SAN:-0}" = 1 ]; then
  cat >/tmp/tiny.py <<'PY'
import torch, hf_flash
from hf_flash import reference
for causal, hk, deterministic, d in ((False, 2, False, 64), (True, 1, True, 64), (True, 2, False, 128), (False, 1, False, 256)):
    q = torch.randn(2, 77, 4, d, device="cuda", dtype=torch.bfloat16); k = torch.randn(2, 150, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k); dout = torch.randn_like(q)
    out, lse = reference.fwd(q, k, v, None, None, None, 77, 150, d**-0.5, causal, -1, -1, 0.0, None, 0.0, None)
    torch.ops.hf_flash._cuda_bwd(dout, q, k, v, out, lse, None, None, 77, 150, d**-0.5, causal, -1, 0 if causal else -1, 0.0, None, 0.0, None, deterministic)
torch.cuda.synchronize()
PY
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool python3 /tmp/tiny.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|error" | head -5 | sed "s/^/$tool: /" | tee -a "$OUT/log"
  done
fi
for v in ${VTESTS:-}; do
  HF_FLASH_BWD_VARIANT=$v timeout 120 python3 -m pytest -q --tb=line -rf --no-header -p no:cacheprovider \
    tests/test_kernels_bwd.py -k "64 or 128 or deterministic" 2>&1 | tail -4 | sed "s/^/variant $v tests: /" | tee -a "$OUT/log"
done
for spec in ${NCU:-}; do
  IFS=: read d s c v <<<"$spec"
  HF_FLASH_BWD_VARIANT=${v:-0} timeout 150 ncu ${NCU_ARGS:---set full} --clock-control none -k regex:main_kernel --launch-count 1 \
    python3 scripts/bwd_profile.py $d $s $c >"$OUT/ncu_d${d}_s${s}_c${c}_v${v:-0}.txt" 2>&1; echo "ncu $spec rc=$?" | tee -a "$OUT/log"
  grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Shared Memory Throughput|Issue Slots Busy|No Eligible|Executed Ipc A|Stall|stall" \
    "$OUT/ncu_d${d}_s${s}_c${c}_v${v:-0}.txt" | head -30 | sed "s/^/  /" | tee -a "$OUT/log"
done
for v in ${VARIANTS:-}; do  # deterministic rows (first S, non-causal) for the default only
  HF_FLASH_BWD_VARIANT=$v timeout 150 python3 benchmarks/bench_bwd.py --seqlens ${SEQLENS:-2048,8192} $([ "$v" = 0 ] || echo --no-det) \
    --csv "$OUT/variant_$v.csv" >>"$OUT/log" 2>&1 || echo "variant $v bench failed" | tee -a "$OUT/log"
done
if [ -n "${VARIANTS:-}" ]; then
  python3 - "$OUT" <<'PY' | tee "$OUT/ratios.txt"
import csv, glob, sys
rows = [r for f in sorted(glob.glob(f"{sys.argv[1]}/variant_*.csv")) for r in csv.DictReader(open(f))]
with open(f"{sys.argv[1]}/variants.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0])); w.writeheader(); w.writerows(rows)
variants = sorted({r["variant"] for r in rows}, key=int)
keys = sorted({(int(r["d"]), r["causal"], int(r["seqlen"]), r["deterministic"]) for r in rows})
print(f"{rows[0]['gpu']}: ours / SDPA-flash TFLOP/s ratio (same run); TFLOP/s of variant {variants[0]}")
print("d    causal S      det   " + "  ".join(f"v{v:<5}" for v in variants) + "  tflops")
for k in keys:
    got = {r["variant"]: r for r in rows if (int(r["d"]), r["causal"], int(r["seqlen"]), r["deterministic"]) == k}
    cells = "  ".join(f"{float(got[v]['ratio']):<6.3f}" if v in got else "-     " for v in variants)
    first = got.get(variants[0])
    print(f"{k[0]:<4} {k[1]:<6} {k[2]:<6} {k[3]:<5} {cells}  {first['ours_tflops'] if first else '-'}/{first['sdpa_flash_tflops'] if first else '-'}")
PY
  rm -f "$OUT"/variant_*.csv  # merged into variants.csv (few files come back from the machine)
fi
if [ "${BENCH:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/bench_bwd.py --csv "$OUT/bench_bwd.csv" 2>&1 | tail -20 | tee -a "$OUT/log"
fi
