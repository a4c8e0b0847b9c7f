#!/usr/bin/env bash
# One device call for the fused-decode work: build, correctness (cuda_check, 28 checks), memcheck of the new
# decode path on an awkward tiny config (if time allows), then the decode/prefill benchmark. Short table last.
#   bash dev/cuda_decode_run.sh GIT_SHA      (repository root of the device copy; files under $OUT)
set -u
export PYTHONUNBUFFERED=1
SHA=${1:-unknown}
OUT=${OUT:-/tmp/lily_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv,noheader
if ! { cmake -S . -B build/h200 -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Release \
       && ninja -C build/h200; } > /tmp/build.log 2>&1; then
  cp /tmp/build.log "$OUT/build.log"; tail -40 /tmp/build.log; echo "BUILD FAILED"; exit 1
fi
cp build/h200/_lily*.so src/lily/
export PYTHONPATH=src
echo "[$(el)s] built"

python3 benchmarks/cuda_check.py --tokens 256 --json "$OUT/cuda_check.json" > "$OUT/cuda_check.txt" 2>&1
RC=$?
grep -E "FAIL|exception|capture failed" "$OUT/cuda_check.txt" | cut -c1-300 | head -12
echo "[$(el)s] cuda_check (default decode = fused + graph) rc=$RC: $(tail -1 "$OUT/cuda_check.txt")"
if [ $RC -ne 0 ]; then
  for m in fused legacy; do
    LILY_CUDA_DECODE=$m python3 benchmarks/cuda_check.py --tokens 256 >> "$OUT/cuda_check_alt.txt" 2>&1
    echo "  cuda_check with LILY_CUDA_DECODE=$m rc=$?: $(tail -1 "$OUT/cuda_check_alt.txt")"
  done
fi

CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ "$(el)" -lt 140 ] && [ -n "$CS" ]; then
  timeout 50 "$CS" --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_check.py --configs tiny_odd \
    --tokens 48 > "$OUT/memcheck.txt" 2>&1
  MRC=$?
  echo "[$(el)s] memcheck tiny_odd (graph decode) rc=$MRC; $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.txt")"
  grep -m2 -A6 "Invalid" "$OUT/memcheck.txt" | cut -c1-200
fi

LILY_GIT_SHA=$SHA python3 benchmarks/bench_cuda.py --out "$OUT" > "$OUT/bench.txt" 2>&1
echo "[$(el)s] bench rc=$?"
tail -48 "$OUT/bench.txt"
echo "cuda_check: rc=$RC $(tail -1 "$OUT/cuda_check.txt")"
