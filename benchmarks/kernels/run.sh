#!/usr/bin/env bash
# The CUDA kernel timing drivers: every benchmarks/kernels/time_*.cu is a standalone program that times the kernels the
# engine calls (csrc/cuda/*.cuh) at the model's shapes and prints one TIME line per shape. Correctness is not theirs:
# tests/kernels/test_cuda_*.py run the same kernels against lily.reference. Each file names the sources it needs on a
# line "// build: csrc/cuda/a.cu csrc/cuda/b.cu".
#   bash benchmarks/kernels/run.sh [filter]        build and run them (repository root; logs under $OUT if set)
#   BUILD_ONLY=1 bash benchmarks/kernels/run.sh    build every driver, run none
#   BUILD_ONLY=1 PTX_ONLY=1 ...                    CI (no GPU): whether every driver compiles and links, cheaply: each
#                                                  source compiled once (the drivers share most), PTX only (no ptxas),
#                                                  host -O0; about half of a full build's time
#   SANITIZE=memcheck bash benchmarks/kernels/run.sh   each driver with --once (one untimed launch per shape) under
#                                                  compute-sanitizer --tool $SANITIZE (memcheck, racecheck, initcheck,
#                                                  synccheck); any report fails the run
#   KBIN=dir                                      where the programs go (default /tmp/lily_kbin)
#   PREBUILT=1                                    run the programs already in KBIN (built with BUILD_ONLY=1)
set -u
OUT=${OUT:-/tmp/lily_kernels}
KBIN=${KBIN:-/tmp/lily_kbin}
mkdir -p "$OUT" "$KBIN"
NVCC=${NVCC:-nvcc}
FLAGS="-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc"
rc=0
summary=()
build() {  # build one driver; its exit status lands in a file so the builds can run in parallel
  local src=$1 name=$2 deps
  deps=$(sed -n 's#^// build: ##p' "$src" | head -1)
  $NVCC $FLAGS -o "$KBIN/$name" "$src" $deps > "$OUT/$name.build.txt" 2>&1
  echo $? > "$OUT/$name.build.rc"
}
if [ -n "${PTX_ONLY:-}" ]; then
  FLAGS="-std=c++17 -O0 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=compute_90a -Icsrc"
  mkdir -p "$KBIN/obj"
  obj() { echo "$KBIN/obj/$(echo "$1" | tr '/' '_').o"; }
  deps_of() { echo "$1"; sed -n 's#^// build: ##p' "$1" | head -1 | tr ' ' '\n' | sed '/^$/d'; }
  for src in benchmarks/kernels/time_*.cu; do deps_of "$src"; done | sort -u |
    while read -r f; do echo "$f $(obj "$f")"; done |
    xargs -n 2 -P "$(nproc)" sh -c "$NVCC $FLAGS -c \$0 -o \$1 2> \$1.txt || rm -f \$1"
  link() {  # the driver from the objects; a source that failed to compile is compiled again for its errors
    local src=$1 name=$2 objs="" f
    for f in $(deps_of "$src"); do
      [ -f "$(obj "$f")" ] || $NVCC $FLAGS -c "$f" -o "$(obj "$f")" || return 1
      objs="$objs $(obj "$f")"
    done
    $NVCC $FLAGS -o "$KBIN/$name" $objs
  }
  build() {
    link "$1" "$2" > "$OUT/$2.build.txt" 2>&1
    echo $? > "$OUT/$2.build.rc"
  }
fi
for src in benchmarks/kernels/time_*.cu; do
  name=$(basename "$src" .cu)
  if [ -n "${1:-}" ] && [[ "$name" != *"$1"* ]]; then continue; fi
  if [ -n "${PREBUILT:-}" ] && [ -x "$KBIN/$name" ]; then echo 0 > "$OUT/$name.build.rc"; continue; fi
  build "$src" "$name" &
done
wait
if [ -n "${BUILD_ONLY:-}" ]; then  # CI: every driver compiles and links against its "// build:" line
  for rcf in "$OUT"/*.build.rc; do
    name=$(basename "$rcf" .build.rc)
    if [ "$(cat "$rcf")" != 0 ]; then echo "BUILD FAILED $name"; grep -m10 -E "error" "$OUT/$name.build.txt"; rc=1
    else echo "built $name"; fi
  done
  exit $rc
fi
for src in benchmarks/kernels/time_*.cu; do
  name=$(basename "$src" .cu)
  if [ -n "${1:-}" ] && [[ "$name" != *"$1"* ]]; then continue; fi
  if [ "$(cat "$OUT/$name.build.rc")" != 0 ]; then
    echo "== $name: BUILD FAILED"; tail -20 "$OUT/$name.build.txt"; summary+=("$name BUILD-FAILED"); rc=1; continue
  fi
  if [ -n "${SANITIZE:-}" ]; then
    timeout 1200 compute-sanitizer --tool "$SANITIZE" --error-exitcode 3 "$KBIN/$name" --once > "$OUT/$name.txt" 2>&1
  else
    timeout 600 "$KBIN/$name" > "$OUT/$name.txt" 2>&1
  fi
  r=$?
  echo "== $name (rc=$r)"; tail -60 "$OUT/$name.txt"
  summary+=("$name rc=$r")
  [ $r -ne 0 ] && rc=1
done
echo "---- kernel drivers${SANITIZE:+ under compute-sanitizer --tool $SANITIZE} ----"
for s in "${summary[@]}"; do echo "$s"; done
exit $rc
