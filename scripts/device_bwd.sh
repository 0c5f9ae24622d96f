#!/bin/bash
# One device call for the backward kernels: build (sm90a only, to save build
# time), tests, compute-sanitizer on a tiny case, benchmark. Usage on the device:
#   bash scripts/device_bwd.sh [pytest -k expression]
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=90a MAX_JOBS=16 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/log"
start=$(date +%s)
if ! python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  echo "full build failed, building without the forward" | tee -a "$OUT/log"
  HF_FLASH_DISABLE_FORWARD=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build $(( $(date +%s) - start )) s" | tee -a "$OUT/log"
timeout 240 python3 -m pytest -q --tb=line -rf --no-header -p no:cacheprovider tests/test_kernels_bwd.py tests/test_train_gpu.py \
  ${1:+-k "$1"} 2>&1 | tail -25 | tee -a "$OUT/log"
cat >/tmp/tiny.py <<'PY'
import torch, hf_flash
from hf_flash import reference
for causal, hk, deterministic in ((False, 2, False), (True, 1, True)):
    q = torch.randn(2, 77, 4, 64, device="cuda", dtype=torch.bfloat16); k = torch.randn(2, 150, hk, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k); dout = torch.randn_like(q)
    out, lse = reference.fwd(q, k, v, None, None, None, 77, 150, 0.125, causal, -1, -1, 0.0, None, 0.0, None)
    torch.ops.hf_flash._cuda_bwd(dout, q, k, v, out, lse, None, None, 77, 150, 0.125, causal, -1, 0 if causal else -1, 0.0, None, 0.0, None, deterministic)
torch.cuda.synchronize()
PY
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool python3 /tmp/tiny.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|error" | head -5 | sed "s/^/$tool: /" | tee -a "$OUT/log"
done
timeout 200 python3 benchmarks/bench_bwd.py --csv "$OUT/bench_bwd.csv" 2>&1 | tail -20 | tee -a "$OUT/log"
