#!/usr/bin/env bash
# Compile-checks every kernel translation unit with bare nvcc (no torch headers)
# for sm_80 and sm_90a. Usage: tools/check_kernels.sh [jobs]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null; then
  echo "check_kernels: nvcc not found; kernel compile check skipped"
  exit 0
fi
jobs=${1:-$(nproc)}
python3 csrc/generate_kernels.py
if ! git diff --quiet -- 'csrc/*/generated' || [ -n "$(git ls-files --others --exclude-standard 'csrc/*/generated')" ]; then
  echo "check_kernels: csrc/*/generated is stale; run python csrc/generate_kernels.py and commit"
  exit 1
fi
mapfile -t files < <(find csrc -name '*.cu' | sort)
echo "check_kernels: nvcc $(nvcc --version | grep -o 'release [0-9.]*'), ${#files[@]} files, sm_80 + sm_90a, $jobs jobs"
start=$SECONDS
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} sh -c \
  'nvcc -std=c++17 -O3 -Icsrc --expt-relaxed-constexpr -gencode=arch=compute_80,code=sm_80 \
        -gencode=arch=compute_90a,code=sm_90a -c "{}" -o /dev/null || { echo "FAILED: {}"; exit 255; }'
echo "check_kernels: ${#files[@]} files compiled in $((SECONDS - start))s"
