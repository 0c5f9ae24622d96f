#!/bin/bash
# One device call for the backward kernels. Usage on the device (all steps optional by env):
#   TESTS=1 SAN=1 SASS=1 VARIANTS="d:v d:v" NCU="d:S:causal ..." BENCH=1 bash scripts/device_bwd.sh [pytest -k expr]
# Builds sm90a only (build time); VARIANTS runs bench_bwd.py at S 4k per HF_FLASH_BWD_VARIANT;
# BENCH=1 runs the full table into $OUT/bench_bwd.csv (printed last).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=90a MAX_JOBS=16 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# pyproject installs top-level patches/ as hf_flash.patches; mirror that for the uninstalled checkout.
[ -e hf_flash/patches ] || ln -s ../patches hf_flash/patches
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/log"
start=$(date +%s)
if ! python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  echo "full build failed, building without the forward" | tee -a "$OUT/log"
  HF_FLASH_DISABLE_FORWARD=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build $(( $(date +%s) - start )) s" | tee -a "$OUT/log"
so=$(ls hf_flash/_C*.so | head -1)
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
for dv in ${VARIANTS:-}; do
  d=${dv%%:*} v=${dv##*:}
  HF_FLASH_BWD_VARIANT=$v timeout 100 python3 benchmarks/bench_bwd.py --dims $d --seqlens 4096 --no-det 2>&1 | tail -3 | sed "s/^/v$v: /" | tee -a "$OUT/log"
done
for spec in ${NCU:-}; do
  IFS=: read d s c <<<"$spec"
  timeout 150 ncu ${NCU_ARGS:---set full} --clock-control none -k regex:main_kernel --launch-count 1 python3 scripts/bwd_profile.py $d $s $c \
    >"$OUT/ncu_d${d}_s${s}_c${c}.txt" 2>&1; echo "ncu $spec rc=$?" | tee -a "$OUT/log"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Shared Memory Throughput|Issue Slots Busy|No Eligible|Executed Ipc A|Stall|stall" "$OUT/ncu_d${d}_s${s}_c${c}.txt" | head -40 | sed "s/^/  /" | tee -a "$OUT/log"
done
if [ "${BENCH:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/bench_bwd.py --csv "$OUT/bench_bwd.csv" 2>&1 | tail -20 | tee -a "$OUT/log"
fi
