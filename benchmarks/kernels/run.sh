#!/usr/bin/env bash
# Kernel-level checks on the GPU: every benchmarks/kernels/check_*.cu is a standalone program that compares
# one CUDA kernel family with its reference twin (fresh random inputs, awkward shapes, outputs poisoned with
# NaN first), times the fast path, prints one line per case and ends with "SUMMARY <family> <pass>/<total>".
# Each file names the sources it needs on a line "// build: csrc/cuda/a.cu csrc/cuda/b.cu".
#   bash benchmarks/kernels/run.sh [filter]        (repository root; logs under $OUT if set)
#   BUILD_ONLY=1 bash benchmarks/kernels/run.sh    build every program, run none (CI, no GPU needed)
#   KBIN=dir                                      where the programs go (default /tmp/lily_kbin)
#   PREBUILT=1                                    run the programs already in KBIN (built on another machine
#                                                 with BUILD_ONLY=1: saves the device's build minutes)
set -u
OUT=${OUT:-/tmp/lily_kernels}
KBIN=${KBIN:-/tmp/lily_kbin}
mkdir -p "$OUT" "$KBIN"
NVCC=${NVCC:-nvcc}
FLAGS="-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc"
rc=0
summary=()
build() {  # build one check program; its exit status lands in a file so the builds can run in parallel
  local src=$1 name=$2 deps
  deps=$(sed -n 's#^// build: ##p' "$src" | head -1)
  $NVCC $FLAGS -o "$KBIN/$name" "$src" $deps > "$OUT/$name.build.txt" 2>&1
  echo $? > "$OUT/$name.build.rc"
}
for src in benchmarks/kernels/check_*.cu; do
  name=$(basename "$src" .cu)
  if [ -n "${1:-}" ] && [[ "$name" != *"$1"* ]]; then continue; fi
  if [ -n "${PREBUILT:-}" ] && [ -x "$KBIN/$name" ]; then echo 0 > "$OUT/$name.build.rc"; continue; fi
  build "$src" "$name" &
done
wait
if [ -n "${BUILD_ONLY:-}" ]; then  # CI: every program compiles and links against its "// build:" line
  for rcf in "$OUT"/*.build.rc; do
    name=$(basename "$rcf" .build.rc)
    if [ "$(cat "$rcf")" != 0 ]; then echo "BUILD FAILED $name"; grep -m10 -E "error" "$OUT/$name.build.txt"; rc=1
    else echo "built $name"; fi
  done
  exit $rc
fi
for src in benchmarks/kernels/check_*.cu; do
  name=$(basename "$src" .cu)
  if [ -n "${1:-}" ] && [[ "$name" != *"$1"* ]]; then continue; fi
  if [ "$(cat "$OUT/$name.build.rc")" != 0 ]; then
    echo "== $name: BUILD FAILED"; tail -20 "$OUT/$name.build.txt"; summary+=("$name BUILD-FAILED"); rc=1; continue
  fi
  timeout 240 "$KBIN/$name" > "$OUT/$name.txt" 2>&1
  r=$?
  echo "== $name (rc=$r)"; cat "$OUT/$name.txt" | tail -60
  summary+=("$name rc=$r $(grep -m1 '^SUMMARY' "$OUT/$name.txt")")
  [ $r -ne 0 ] && rc=1
done
echo "---- kernel checks ----"
for s in "${summary[@]}"; do echo "$s"; done
exit $rc
