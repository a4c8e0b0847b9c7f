#!/usr/bin/env bash
# One device call that builds lily on the H200 and checks it: kernel-level twins (benchmarks/kernels/run.sh),
# whole-model checks against the CPU engine (cuda_check.py, tiny and mid configs), compute-sanitizer memcheck,
# then optionally a step (full-size checkpoint + correctness, or the benchmark). Short summary last.
#   bash dev/cuda_session_run.sh quick        build + cuda_check
#   bash dev/cuda_session_run.sh check        build + kernel checks + cuda_check + memcheck
#   bash dev/cuda_session_run.sh full         build + full-size checkpoint + full-size correctness
#   bash dev/cuda_session_run.sh bench ARGS   build + full-size checkpoint + bench_cuda.py ARGS
#   bash dev/cuda_session_run.sh verify ARGS  build + the kernel checks named in KCHECKS (e.g. "small decode")
#        + cuda_check on the tiny configs + memcheck and racecheck on tiny_odd; then, with ARGS, the benchmark,
#        and with FULL_TIMEOUT=seconds the full-size envelope check after it
# Files land under $OUT (the device tool's output folder). Pass LILY_GIT_SHA=$(git rev-parse HEAD) from the calling
# machine: the device's copy of .git can be stale, and the benchmark JSON records the sha.
set -u
export PYTHONUNBUFFERED=1
MODE=${1:-check}
shift || true
OUT=${OUT:-/tmp/lily_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
SUMMARY=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ ! -f build/h200/build.ninja ]; then
  cmake -S . -B build/h200 -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Release \
    > /tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
fi
if ! ninja -C build/h200 > /tmp/build.log 2>&1; then
  cp /tmp/build.log "$OUT/build.log"; grep -m20 -E "error" /tmp/build.log; echo "BUILD FAILED"; exit 1
fi
cp build/h200/_lily*.so src/lily/
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
echo "[$(el)s] built"

case "$MODE" in
quick)
  python3 benchmarks/cuda_check.py --tokens 256 --json "$OUT/cuda_check.json" > "$OUT/cuda_check.txt" 2>&1
  CRC=$?
  grep -E "FAIL|Error|error|exception" "$OUT/cuda_check.txt" | cut -c1-300 | head -15
  tail -32 "$OUT/cuda_check.txt" | cut -c1-160
  SUMMARY+=("cuda_check rc=$CRC: $(tail -1 "$OUT/cuda_check.txt")")
  ;;
check)
  bash benchmarks/kernels/run.sh > "$OUT/kernels.txt" 2>&1
  KRC=$?
  grep -E "^(FAIL|TIME|== )|BUILD FAILED|error" "$OUT/kernels.txt" | cut -c1-230 | head -60
  SUMMARY+=("kernel checks rc=$KRC: $(sed -n '/---- kernel checks ----/,$p' "$OUT/kernels.txt" | tail -n +2 | tr '\n' ';')")
  echo "[$(el)s] kernel checks rc=$KRC"
  # the decode-chain experiment (not a check: its figures steer the decode design; it self-checks its outputs)
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/exp_stage_chain \
    dev/exp_stage_chain.cu > "$OUT/exp_stage_chain.build.txt" 2>&1 \
    && timeout 120 /tmp/exp_stage_chain > "$OUT/exp_stage_chain.txt" 2>&1
  grep -E "^(TIME|FAIL|SUMMARY|--)" "$OUT/exp_stage_chain.txt" 2>/dev/null | head -24
  SUMMARY+=("exp_stage_chain: $(grep -m1 '^SUMMARY' "$OUT/exp_stage_chain.txt" 2>/dev/null || echo 'did not run')")
  python3 benchmarks/cuda_check.py --tokens 256 --json "$OUT/cuda_check.json" > "$OUT/cuda_check.txt" 2>&1
  CRC=$?
  grep -E "FAIL|Error|error|exception" "$OUT/cuda_check.txt" | cut -c1-300 | head -15
  SUMMARY+=("cuda_check rc=$CRC: $(tail -1 "$OUT/cuda_check.txt")")
  echo "[$(el)s] cuda_check rc=$CRC"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$CS" ]; then
    for cfg in tiny_odd mid_real_heads; do
      timeout 150 "$CS" --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_check.py --configs $cfg \
        --tokens 24 > "$OUT/memcheck_$cfg.txt" 2>&1
      MRC=$?
      grep -m3 -A8 "Invalid\|Error" "$OUT/memcheck_$cfg.txt" | cut -c1-200 | head -12
      SUMMARY+=("memcheck $cfg rc=$MRC $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck_$cfg.txt")")
      echo "[$(el)s] memcheck $cfg rc=$MRC"
    done
    # racecheck instruments every shared-memory access: a tiny config and a few tokens keep it inside the call
    timeout ${RACE_TIMEOUT:-200} "$CS" --tool racecheck --error-exitcode 9 python3 benchmarks/cuda_check.py \
      --configs tiny_odd --tokens 12 --no-bundled > "$OUT/racecheck_tiny_odd.txt" 2>&1
    RRC=$?
    grep -m3 -A8 "Race\|Error" "$OUT/racecheck_tiny_odd.txt" | cut -c1-200 | head -12
    SUMMARY+=("racecheck tiny_odd rc=$RRC $(grep -m1 'RACECHECK SUMMARY\|ERROR SUMMARY' "$OUT/racecheck_tiny_odd.txt")")
    echo "[$(el)s] racecheck tiny_odd rc=$RRC"
  fi
  ;;
verify)
  KFAIL=0
  for k in ${KCHECKS:-}; do
    bash benchmarks/kernels/run.sh "$k" > "$OUT/kernels_$k.txt" 2>&1
    KRC=$?
    [ $KRC -ne 0 ] && KFAIL=1
    SUMMARY+=("kernel check $k rc=$KRC: $(grep '^SUMMARY' "$OUT/kernels_$k.txt" | tr '\n' ';')")
    grep -E "^(FAIL|TIME)|BUILD FAILED" "$OUT/kernels_$k.txt" | cut -c1-200 | head -${KLINES:-12}
  done
  python3 benchmarks/cuda_check.py --configs ${VCONFIGS:-tiny,tiny_dk_ne_dv,tiny_odd,mid_real_heads} --tokens ${VTOKENS:-256} --no-bundled \
    > "$OUT/cuda_check.txt" 2>&1
  SUMMARY+=("cuda_check rc=$?: $(tail -1 "$OUT/cuda_check.txt")")
  grep -E "FAIL|Error|exception" "$OUT/cuda_check.txt" | cut -c1-300 | head -10
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  # SAN_CONFIGS: mid_real_heads has the model's 16 / 2 heads, the shape the tensor-core decode attention serves
  for cfg in ${SAN_CONFIGS:-tiny_odd}; do
    for tool in ${TOOLS:-memcheck racecheck}; do
      timeout ${RACE_TIMEOUT:-240} "$CS" --tool $tool --error-exitcode 9 python3 benchmarks/cuda_check.py --configs $cfg \
        --tokens 12 --no-bundled > "$OUT/${tool}_$cfg.txt" 2>&1
      SUMMARY+=("$tool $cfg rc=$? $(grep -m1 'RACECHECK SUMMARY\|ERROR SUMMARY' "$OUT/${tool}_$cfg.txt")")
      echo "[$(el)s] $tool $cfg done"
    done
  done
  if [ $# -gt 0 ] && [ $KFAIL = 1 ] && [ "${BENCH_ON_FAIL:-0}" = 0 ]; then
    SUMMARY+=("bench skipped: a kernel check failed (a wrong kernel's speed means nothing; BENCH_ON_FAIL=1 runs it)")
  elif [ $# -gt 0 ]; then
    CK=/tmp/full35b
    [ -f $CK/config.json ] || python3 benchmarks/full_checkpoint.py $CK > "$OUT/full_checkpoint.txt" 2>&1
    timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_cuda.py --checkpoint $CK --out "$OUT" "$@" \
      > "$OUT/bench.txt" 2>&1
    SUMMARY+=("bench rc=$?")
    tail -${BLINES:-30} "$OUT/bench.txt"
    if [ "${FULL_TIMEOUT:-0}" != 0 ]; then  # the full-size envelope (cuda_check --full) after the benchmark
      timeout $FULL_TIMEOUT python3 benchmarks/cuda_check.py --configs none --full $CK \
        --env-positions ${ENV_POSITIONS:-192} --json "$OUT/cuda_check_full.json" > "$OUT/cuda_check_full.txt" 2>&1
      SUMMARY+=("full-size check rc=$?: $(tail -1 "$OUT/cuda_check_full.txt")")
      tail -6 "$OUT/cuda_check_full.txt" | cut -c1-200
    fi
  fi
  ;;
full|bench)
  CK=/tmp/full35b
  if [ ! -f $CK/config.json ]; then
    python3 benchmarks/full_checkpoint.py $CK > "$OUT/full_checkpoint.txt" 2>&1 || { tail -20 "$OUT/full_checkpoint.txt"; exit 1; }
  fi
  echo "[$(el)s] checkpoint ready: $(du -sh $CK | cut -f1)"
  if [ "$MODE" = full ]; then
    python3 benchmarks/cuda_check.py --configs none --full $CK --json "$OUT/cuda_check_full.json" "$@" \
      > "$OUT/cuda_check_full.txt" 2>&1
    FRC=$?
    tail -25 "$OUT/cuda_check_full.txt"
    SUMMARY+=("full-size check rc=$FRC: $(tail -1 "$OUT/cuda_check_full.txt")")
  else  # the benchmark, then (time allowing) the full-size correctness check
    timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_cuda.py --checkpoint $CK --out "$OUT" "$@" \
      > "$OUT/bench.txt" 2>&1
    BRC=$?
    tail -45 "$OUT/bench.txt"
    SUMMARY+=("bench rc=$BRC")
    echo "[$(el)s] bench done"
    if [ "${FULL_TIMEOUT:-240}" = 0 ]; then
      SUMMARY+=("full-size check skipped (FULL_TIMEOUT=0)")
    else
      timeout ${FULL_TIMEOUT:-240} python3 benchmarks/cuda_check.py --configs none --full $CK \
        --env-positions ${ENV_POSITIONS:-192} --json "$OUT/cuda_check_full.json" > "$OUT/cuda_check_full.txt" 2>&1
      FRC=$?
      tail -14 "$OUT/cuda_check_full.txt" | cut -c1-200
      SUMMARY+=("full-size check rc=$FRC: $(tail -1 "$OUT/cuda_check_full.txt")")
    fi
  fi
  ;;
esac
echo "---- summary [$(el)s] ----"
for s in "${SUMMARY[@]}"; do echo "$s"; done
# The device tool brings back only a few files: pack the logs into one archive (JSON and PNG stay beside it).
( cd "$OUT" && find . -maxdepth 1 -type f ! -name '*.json' ! -name '*.png' ! -name logs.tgz -printf '%P\n' \
    | tar czf logs.tgz -T - --remove-files )
