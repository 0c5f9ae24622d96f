#!/usr/bin/env bash
# Compile-checks every kernel translation unit with bare nvcc (no torch headers) for sm_80 and sm_90a (failing
# where ptxas serialises a kernel's wgmmas, its "Potential Performance Loss" notes C7510-C7515: too few registers,
# an accumulator written while a wgmma is in flight, ...; a Hopper kernel that lost its overlap), then
# links the objects of each build that HF_FLASH_DISABLE_{FORWARD,BACKWARD} allows (tools/check_symbols.py):
# every hf_flash function a kept object or csrc/binding.cpp needs must be defined in that build.
# Usage: tools/check_kernels.sh [jobs]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null; then
  echo "check_kernels: nvcc not found; kernel compile check skipped"
  exit 0
fi
jobs=${1:-$(nproc)}
obj=build/check_kernels gen=build/check_kernels_generated
rm -rf "$obj" "$gen" && mkdir -p "$obj"
# Family folders' files (and the instantiations generated for them, as the first-use build does) do not read
# HF_FLASH_DISABLE_*: compiled once. The always-compiled csrc/*.cu are host code, compiled once per combination.
mapfile -t files < <({ find csrc -mindepth 2 -name '*.cu'; python3 csrc/generate_kernels.py "$gen"; } | sort)
jobs_list=()
for f in "${files[@]}"; do jobs_list+=("$f|"); done
for f in csrc/*.cu; do
  for off in none FORWARD BACKWARD; do jobs_list+=("$f|$off"); done
done
echo "check_kernels: nvcc $(nvcc --version | grep -o 'release [0-9.]*'), ${#files[@]} kernel files + $(ls csrc/*.cu | wc -l) always-compiled files x 3, sm_80 + sm_90a, $jobs jobs"
start=$SECONDS
printf '%s\n' "${jobs_list[@]}" | OBJ=$obj xargs -P "$jobs" -I{} sh -c '
  f=${1%%|*} off=${1#*|} base=$(basename "$f" .cu)
  if [ -n "$off" ]; then out=$OBJ/top__$base.$off.o; else out=$OBJ/$(basename "$(dirname "$f")")__$base.o; fi
  def=""; [ -n "$off" ] && [ "$off" != none ] && def="-DHF_FLASH_DISABLE_$off"
  log=$(nvcc -std=c++17 -O3 -Icsrc --expt-relaxed-constexpr $def -gencode=arch=compute_80,code=sm_80 \
       -gencode=arch=compute_90a,code=sm_90a -c "$f" -o "$out" 2>&1) || { echo "$log"; echo "FAILED: $f $def"; exit 255; }
  serial="wgmma.mma_async instructions are serialized"
  if echo "$log" | grep -q "$serial"; then echo "$log" | grep "$serial"; echo "FAILED: $f $def: wgmmas serialised"; exit 255; fi' _ {}
echo "check_kernels: compiled in $((SECONDS - start))s"
python3 tools/check_symbols.py "$obj"
# The tensor-core ceiling probe (tools/tensor_peak.cu) shares the wgmma primitives: it must keep compiling.
log=$(nvcc -std=c++17 -O3 -Icsrc -arch=sm_90a tools/tensor_peak.cu -o "$obj/tensor_peak" 2>&1) ||
  { echo "$log"; echo "FAILED: tools/tensor_peak.cu"; exit 1; }
