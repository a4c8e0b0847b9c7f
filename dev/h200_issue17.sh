#!/usr/bin/env bash
# Issue 17's H200 acceptance, in two device calls of under ten minutes each (files under $OUT).
#
# On the calling machine first: the "before" tree (issue 17's starting commit) in an ignored folder, carried:
#   git archive 82eaca8 | (mkdir -p .before && tar -x -C .before)      # then run(carry=[".before"])
#
#   LILY_GIT_SHA=$(git rev-parse --short HEAD) bash dev/h200_issue17.sh verify   # call 1
#     build; every kernel family's check programs; the whole-model checks on the tiny configs (incl. the device
#     token streams, run-ahead after a stop string, graph == no graph); the CUDA cases of the pytest suite;
#     memcheck + racecheck on tiny_odd and mid_real_heads; the full-size envelope
#   LILY_GIT_SHA=$(git rev-parse --short HEAD) bash dev/h200_issue17.sh bench    # call 2
#     build before (.before) and after; prefill and decode at 512, 4K, 32K, 128K, alternating, 3 rounds
#     (dev/compare_builds.py); the gemv_impl A/B (dev/ab_gemv.py, 5 rounds)
# Then (time allowing, a third call): bash dev/cuda_session_run.sh bench --lengths 512,4096,32768,131072 for the
# benchmark JSON with llama.cpp as the peer (see ../shared/peers/llamacpp) and the Model.generate rows.
set -u
export PYTHONUNBUFFERED=1
MODE=${1:-verify}
OUT=${OUT:-/tmp/lily_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
SUMMARY=()

build() {  # build SRC_DIR BUILD_DIR: the extension into SRC_DIR/src/lily
  local src=$1 dir=$2
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S "$src" -B "$dir" -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Release \
      > "$OUT/cmake_$(basename "$dir").log" 2>&1 || { tail -20 "$OUT/cmake_$(basename "$dir").log"; return 1; }
  fi
  ninja -C "$dir" > "$OUT/build_$(basename "$dir").log" 2>&1 || { grep -m20 error "$OUT/build_$(basename "$dir").log"; return 1; }
  cp "$dir"/_lily*.so "$src/src/lily/"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
build . build/h200 || { echo "BUILD FAILED"; exit 1; }
echo "[$(el)s] built"
export PYTHONPATH=src

case "$MODE" in
verify)
  bash benchmarks/kernels/run.sh > "$OUT/kernels.txt" 2>&1
  SUMMARY+=("kernel checks rc=$?: $(grep '^SUMMARY' "$OUT/kernels.txt" | tr '\n' ';')")
  echo "[$(el)s] kernel checks"
  python3 -m pytest -q tests/kernels tests/test_cuda_backend.py -x > "$OUT/pytest_cuda.txt" 2>&1
  SUMMARY+=("pytest (cuda cases) rc=$?: $(tail -1 "$OUT/pytest_cuda.txt")")
  python3 benchmarks/cuda_check.py --configs tiny,tiny_dk_ne_dv,tiny_odd,mid_real_heads --tokens 256 --no-bundled \
    --json "$OUT/cuda_check.json" > "$OUT/cuda_check.txt" 2>&1
  SUMMARY+=("cuda_check rc=$?: $(tail -1 "$OUT/cuda_check.txt")")
  grep -E "FAIL|Error|exception" "$OUT/cuda_check.txt" | cut -c1-240 | head -10
  echo "[$(el)s] cuda_check"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for cfg in tiny_odd mid_real_heads; do
    for tool in memcheck racecheck; do
      timeout 150 "$CS" --tool $tool --error-exitcode 9 python3 benchmarks/cuda_check.py --configs $cfg --tokens 12 \
        --no-bundled > "$OUT/${tool}_$cfg.txt" 2>&1
      SUMMARY+=("$tool $cfg rc=$? $(grep -m1 'RACECHECK SUMMARY\|ERROR SUMMARY' "$OUT/${tool}_$cfg.txt")")
    done
  done
  echo "[$(el)s] sanitizers"
  CK=/tmp/full35b
  [ -f $CK/config.json ] || python3 benchmarks/full_checkpoint.py $CK > "$OUT/full_checkpoint.txt" 2>&1
  timeout 200 python3 benchmarks/cuda_check.py --configs none --full $CK --env-positions 192 \
    --json "$OUT/cuda_check_full.json" > "$OUT/cuda_check_full.txt" 2>&1
  SUMMARY+=("full-size envelope rc=$?: $(tail -1 "$OUT/cuda_check_full.txt")")
  ;;
bench)
  [ -d .before ] || { echo "no .before tree: see the header"; exit 1; }
  build .before build/h200_before || { echo "BEFORE BUILD FAILED"; exit 1; }
  echo "[$(el)s] built before"
  timeout 420 python3 dev/compare_builds.py --builds before=.before/src,after=src --rounds 3 \
    --out "$OUT/compare_builds_h200.json" > "$OUT/compare_builds.txt" 2>&1
  SUMMARY+=("compare_builds rc=$?")
  tail -12 "$OUT/compare_builds.txt"
  timeout 150 python3 dev/ab_gemv.py --rounds 5 --out "$OUT/ab_gemv_h200.json" > "$OUT/ab_gemv.txt" 2>&1
  SUMMARY+=("ab_gemv rc=$?")
  tail -8 "$OUT/ab_gemv.txt"
  ;;
esac
echo "---- summary [$(el)s] ----"
for s in "${SUMMARY[@]}"; do echo "$s"; done
