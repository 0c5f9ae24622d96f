#!/bin/bash
# One device call for the forward kernel: build, tile tuner, tests, memcheck, benchmark.
#   STAGES="tune test sanitize bench" BENCH_ARGS="--quick" bash scripts/device_fwd.sh
# Logs go to $OUT (or out/); the last lines printed are the benchmark table.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_FLASH_CUDA_ARCHS=${HF_FLASH_CUDA_ARCHS:-90a}  # sm_80 is compile-checked off-device
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD
# pyproject installs top-level patches/ as hf_flash.patches; mirror that for the uninstalled checkout.
[ -e hf_flash/patches ] || ln -s ../patches hf_flash/patches
OUT=${OUT:-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"tune test sanitize bench"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# The tuner binary (built off-device, carried in out/) times tile configs while the extension builds.
if [[ " $STAGES " == *" tune "* && -x out/fwd_tune ]]; then
  (out/fwd_tune > "$OUT/tune.log" 2>&1 &)
fi
start=$(date +%s)
export HF_FLASH_DISABLE_BACKWARD=1  # at run time too: it is part of the build's cache key
python3 -m hf_flash build > "$OUT/build.log" 2>&1 || {
  tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
while pgrep -x fwd_tune > /dev/null; do sleep 2; done
[[ -f "$OUT/tune.log" ]] && cat "$OUT/tune.log"

if [[ " $STAGES " == *" test "* ]]; then
  timeout 300 python3 -m pytest tests/test_kernels_fwd.py -q -p no:cacheprovider --tb=short --maxfail=15 \
    2>&1 | tee "$OUT/test.log" | tail -60
fi
if [[ " $STAGES " == *" sanitize "* ]]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --print-limit 5 \
    python3 scripts/fwd_sanitize.py 2>&1 | tail -12
fi
if [[ " $STAGES " == *" bench "* ]]; then
  timeout 300 python3 -m hf_flash.bench kernels --mode fwd ${BENCH_ARGS:-} --out "$OUT/bench" 2>&1 \
    | tee "$OUT/bench.log" | grep -v "kernels:" | tail -60
fi
