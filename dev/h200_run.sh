#!/usr/bin/env bash
# The H200 runner (issues 17, 14 and 15), one device call per mode (each under ten minutes; the machine goes back
# after 30 s idle, so back-to-back calls must be issued at once). Files under $OUT: at most 8 come back, so the
# logs travel as one logs.tgz.
#
# On the calling machine first (2 cores are enough; it saves the device's build minutes):
#   git archive 82eaca8 | (mkdir -p .before && tar -x -C .before)      # the "before" tree of issue 17
#   PY12=~/.pyenv/versions/3.12.1/bin/python3 bash dev/h200_prebuild.sh  # .h200/: extensions for the device's
#       Python 3.12 (this tree, .before), the kernel check programs, gemv_lab, the experiments, gemm_lab
#   then run(command=..., carry=[".h200/after", ".h200/before", ".h200/kdec", ".before/src", ...]) (64 MiB in all:
#   carry what the mode needs; `final` wants .h200/kdec = check_decode alone, plus the experiments it runs)
#
# Modes (LILY_GIT_SHA=$(git rev-parse --short HEAD) bash dev/h200_run.sh MODE [ARGS]):
#   (the first call of 2026-12-01 ran the correctness checks in parallel lanes: the sanitizers and the envelope
#   starved beside the others, so that mode is gone; gemv_lab runs alone with dev/gemv_lab/run.sh)
#   final     sequential under a DEADLINE (default 560 s), most important first: the kernel checks (every family
#             with .h200/kbin carried, else check_decode), cuda_check, memcheck
#             on tiny_odd and tiny_dk_ne_dv, one before/after round, the experiments and gemm_lab if built, the
#             full-size envelope (200 s), ncu of the decode GEMV (check_decode --profile), the generate rows at 4K
#   ab        changed kernels in a short call: their check programs, cuda_check on two tiny configs, memcheck,
#             compare_builds over BUILDS (several builds: ratios against the first), ncu of the decode GEMV
#   sanitize  racecheck alone on tiny_odd and tiny_dk_ne_dv (230 and 340 s limits: they took 190 and 289 s)
#   bench     3 before/after rounds and the generate rows at 512 and 4K
#   prefill_ncu  ncu of the prefill's launches at 4K and in the last chunk of a 128K prefill, by kernel family
#   sweep     benchmarks/bench_cuda.py ARGS on the full-size checkpoint (the benchmark JSON + PNG into $OUT)
#   trace     the greedy decode step as it runs, launch by launch, marginal time by role (dev/decode_trace.py)
#   verify    from .h200/bz alone (dev/h200_prebuild.sh kbin after before bz; carry .h200/bz): every kernel family's
#             checks, cuda_check on the four configs at 256 tokens, memcheck on tiny_odd and tiny_dk_ne_dv,
#             compare_builds before/after at 512 and 4K, the full-size envelope beside them (~260 s; the eleventh
#             session's call 6); racecheck then takes a call of its own (sanitize, ~470 s)
# A prebuilt extension is used only if it imports on the device; otherwise the script builds there (-j16).
set -u
export PYTHONUNBUFFERED=1
MODE=${1:-final}
OUT=${OUT:-/tmp/lily_out}
LOG=/tmp/lily_logs
mkdir -p "$OUT" "$LOG"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
SUMMARY=()

install_ext() {  # install_ext SRC_DIR PREBUILT_DIR BUILD_DIR: the extension into SRC_DIR/src/lily
  local src=$1 pre=$2 dir=$3
  if ls "$pre"/_lily*.so >/dev/null 2>&1; then
    cp "$pre"/_lily*.so "$src/src/lily/"
    if PYTHONPATH="$src/src" python3 -c "import lily._lily as m; assert 'cuda' in m.build_info()['backends']" \
        > "$LOG/import_$(basename "$pre").txt" 2>&1; then echo "prebuilt $pre imports"; return 0; fi
    echo "prebuilt $pre does not import here ($(tail -1 "$LOG/import_$(basename "$pre").txt")): building"
    rm -f "$src"/src/lily/_lily*.so
  fi
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S "$src" -B "$dir" -G Ninja -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Release \
      > "$LOG/cmake_$(basename "$dir").log" 2>&1 || { tail -20 "$LOG/cmake_$(basename "$dir").log"; return 1; }
  fi
  ninja -C "$dir" > "$LOG/build_$(basename "$dir").log" 2>&1 || { grep -m20 error "$LOG/build_$(basename "$dir").log"; return 1; }
  cp "$dir"/_lily*.so "$src/src/lily/"
}

finish() {
  tar -czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
  echo "---- summary [$(el)s] ----"
  for s in "${SUMMARY[@]}"; do echo "$s"; done
}
trap finish EXIT

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [ "$MODE" = verify ]; then  # the compressed binaries (see the header): the extensions, the check programs
  mkdir -p .h200/after .h200/before .h200/kbin
  xz -dc .h200/bz/after.so.xz > .h200/after/_lily.cpython-312-x86_64-linux-gnu.so
  xz -dc .h200/bz/before.so.xz > .h200/before/_lily.cpython-312-x86_64-linux-gnu.so
  tar -xJf .h200/bz/kbin.tar.xz -C .h200/kbin
fi
install_ext . .h200/after build/h200 || { echo "BUILD FAILED"; exit 1; }
echo "[$(el)s] extension ready"
export PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then  # the server's packages (dev/h200_prebuild.sh wheels), if carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOG/wheels.txt" 2>&1 && export PYTHONPATH=src:/tmp/site && echo "wheels installed (.whl)"
fi
# every ncu run here collects the same metrics (dev/ncu_table.py reads what it finds)
NCU_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_imc_miss,smsp__pcsamp_warps_issue_stalled_selected
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)

kernel_checks() {  # kernel_checks TIMEOUT: every family's check programs if .h200/kbin is carried, else the decode
  # GEMV's alone (.h200/kdec)
  local kbin=.h200/kdec filter=decode
  [ -d .h200/kbin ] && kbin=.h200/kbin filter=
  PREBUILT=1 KBIN=$kbin OUT=$LOG/kernels timeout "$1" bash benchmarks/kernels/run.sh $filter > "$LOG/kernels.txt" 2>&1
  SUMMARY+=("kernel checks rc=$?: $(sed -n '/---- kernel checks ----/,$p' "$LOG/kernels.txt" | tail -n +2 | tr '\n' ';')")
  grep -E "^(FAIL|TIME)" "$LOG"/kernels/check_*.txt | cut -c1-150 | head -20
  echo "[$(el)s] kernel checks"
}
model_checks() {  # model_checks TIMEOUT: the whole-model checks on the tiny configs (256 tokens)
  timeout "$1" python3 benchmarks/cuda_check.py --configs tiny,tiny_dk_ne_dv,tiny_odd,mid_real_heads --tokens 256 \
    --no-bundled --json "$LOG/cuda_check.json" > "$LOG/cuda_check.txt" 2>&1
  SUMMARY+=("cuda_check rc=$?: $(tail -1 "$LOG/cuda_check.txt")")
  grep -E "FAIL|Error|exception" "$LOG/cuda_check.txt" | cut -c1-200 | head -8
  echo "[$(el)s] cuda_check"
}

ncu_gemv() {  # ncu_gemv CHECK_DECODE: the decode GEMV alone at the real shapes, one cold launch each (--profile)
  timeout 60 ncu --clock-control none --cache-control all --kernel-name regex:gemv_kernel \
    --metrics "$NCU_METRICS" \
    --csv --page raw "$1" --profile > "$LOG/ncu_gemv.csv" 2> "$LOG/ncu_gemv.err"
  SUMMARY+=("ncu gemv rc=$?")
  printf "%s\n" dn_in dn_out sh_gate_up moe_gate_up_x8 lm_head attn_qkv dn_in_norm sh_gate_up_norm moe_down > "$LOG/ncu_labels.txt"
  python3 dev/ncu_table.py <(sed -n '/^"ID"/,$p' "$LOG/ncu_gemv.csv") "$LOG/ncu_labels.txt" | tee "$OUT/ncu_gemv.md"
}

# The full-size envelope is mostly the CPU's bf16 reference (~120 s on 16 cores) and was cut short in every
# sequential slot it got: it runs beside the GPU checks from the start (they use one host core each). Sets ENV_PID.
envelope_start() {
  CK=/tmp/full35b
  ( python3 benchmarks/full_checkpoint.py $CK > "$LOG/full_checkpoint.txt" 2>&1
    timeout 330 python3 benchmarks/cuda_check.py --configs none --full $CK --env-positions 192 \
      --json "$LOG/cuda_check_full.json" > "$LOG/cuda_check_full.txt" 2>&1
    echo "rc=$?" > "$LOG/envelope_rc.txt" ) &
  ENV_PID=$!
}

envelope_wait() {  # the envelope's result into the summary
  wait $ENV_PID
  SUMMARY+=("full-size envelope $(cat "$LOG/envelope_rc.txt"): $(tail -1 "$LOG/cuda_check_full.txt")")
  echo "[$(el)s] envelope"
}
memcheck_cfg() {  # memcheck_cfg CFG: memcheck on one config, 12 tokens (racecheck has its own mode: minutes alone)
  timeout 100 "$CS" --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_check.py --configs $1 --tokens 12 \
    --progress --no-bundled > "$LOG/memcheck_$1.txt" 2>&1
  SUMMARY+=("memcheck $1 rc=$? $(grep -m1 'ERROR SUMMARY' "$LOG/memcheck_$1.txt")")
  echo "[$(el)s] memcheck $1"
}

families_md() {  # families_md NCU_CSV OUT_MD: the by-family table, then the per-launch one (dev/ncu_table.py)
  { python3 dev/ncu_table.py <(sed -n '/^"ID"/,$p' "$1") --families --stalls 3; echo
    python3 dev/ncu_table.py <(sed -n '/^"ID"/,$p' "$1") --stalls 3; } > "$2"
}

case "$MODE" in
final)  # one call, sequential, most important first; a step starts only if DEADLINE seconds are not yet spent
  DEADLINE=${DEADLINE:-560}
  go() { [ "$(el)" -lt "$1" ] || { SUMMARY+=("$2: not run (time)"); return 1; }; }
  envelope_start
  kernel_checks 150
  model_checks 120
  for cfg in tiny_odd tiny_dk_ne_dv; do go $((DEADLINE - 200)) "memcheck $cfg" && memcheck_cfg $cfg; done
  if [ -x .h200/exp_deltanet_step ] && go $((DEADLINE - 230)) "exp_deltanet_step"; then  # issue 14 step 3
    timeout 30 .h200/exp_deltanet_step > "$LOG/exp_deltanet_step.txt" 2>&1
    SUMMARY+=("exp_deltanet_step rc=$?: $(grep -m1 '^SUMMARY' "$LOG/exp_deltanet_step.txt")")
    grep -E "^(PASS|FAIL)" "$LOG/exp_deltanet_step.txt" | head -2
  fi
  if [ -x .h200/gemm_lab ] && go $((DEADLINE - 230)) "gemm_lab"; then  # issue 15: the wgmma GEMM candidate
    timeout 60 .h200/gemm_lab > "$LOG/gemm_lab.txt" 2>&1
    SUMMARY+=("gemm_lab rc=$?: $(grep -m1 '^SUMMARY' "$LOG/gemm_lab.txt")")
    grep -E "^(PASS|FAIL)" "$LOG/gemm_lab.txt" | cut -c1-200 | head -6
  fi
  envelope_wait
  if go $((DEADLINE - 150)) "compare_builds" && install_ext .before .h200/before build/h200_before; then
    timeout 100 python3 dev/compare_builds.py --builds before=.before/src,after=src --rounds 1 \
      --out "$OUT/compare_builds_h200.json" > "$LOG/compare.txt" 2>&1
    SUMMARY+=("compare_builds rc=$?"); tail -10 "$LOG/compare.txt"
    echo "[$(el)s] compare_builds"
  fi
  if go $((DEADLINE - 60)) "ncu"; then  # the decode GEMV alone at the real shapes: check_decode --profile
    ncu_gemv .h200/kdec/check_decode
  fi
  if go $((DEADLINE - 45)) "bench generate"; then
    timeout 60 python3 benchmarks/bench_cuda.py --checkpoint $CK --lengths 4096 --no-mlx --no-ablations \
      --budget-s 50 --out "$LOG" --name bench_cuda_generate_h200 > "$LOG/bench_generate.txt" 2>&1
    SUMMARY+=("bench_cuda (generate rows) rc=$?")
    grep -E "decode|family|gemv" "$LOG/bench_generate.txt" | tail -14
    cp "$LOG"/bench_cuda_generate_h200.json "$OUT/" 2>/dev/null
  fi
  cp "$LOG/kernels/check_decode.txt" "$LOG/cuda_check.txt" "$OUT/" 2>/dev/null
  ;;
ab)  # a short call for changed kernels: their check programs (KCHECKS, default decode sample attention), cuda_check
    # on two tiny configs, memcheck on tiny_odd, compare_builds over BUILDS (name=path,...; default before/after),
    # ncu of the decode GEMV
  for n in ${KCHECKS:-decode sample attention}; do
    timeout 150 .h200/kbin/check_$n > "$LOG/check_$n.txt" 2>&1
    SUMMARY+=("check_$n rc=$?: $(grep -m1 '^SUMMARY' "$LOG/check_$n.txt")")
    grep -E "^(FAIL|TIME)" "$LOG/check_$n.txt" | cut -c1-150 | head -24
  done
  echo "[$(el)s] kernel checks"
  timeout 120 python3 benchmarks/cuda_check.py --configs tiny_odd,tiny_dk_ne_dv --tokens 64 --no-bundled \
    --json "$LOG/cuda_check.json" > "$LOG/cuda_check.txt" 2>&1
  SUMMARY+=("cuda_check (2 configs) rc=$?: $(tail -1 "$LOG/cuda_check.txt")")
  grep -E "FAIL|Error|exception" "$LOG/cuda_check.txt" | cut -c1-200 | head -8
  echo "[$(el)s] cuda_check"
  memcheck_cfg tiny_odd
  timeout ${COMPARE_TIMEOUT:-200} python3 dev/compare_builds.py --builds "${BUILDS:-before=.before/src,after=src}" \
    --lengths ${COMPARE_LENGTHS:-512,4096} --rounds ${COMPARE_ROUNDS:-2} --out "$OUT/compare_builds_h200.json" \
    > "$LOG/compare.txt" 2>&1
  SUMMARY+=("compare_builds rc=$?"); grep -E "^round|^\||^greedy" "$LOG/compare.txt" | tail -14
  echo "[$(el)s] compare_builds"
  ncu_gemv .h200/kbin/check_decode
  if [ -x .h200/gemm_lab ]; then  # issue 15's wgmma GEMM candidates, if built
    timeout 90 .h200/gemm_lab > "$LOG/gemm_lab.txt" 2>&1
    SUMMARY+=("gemm_lab rc=$?: $(grep -m1 '^SUMMARY' "$LOG/gemm_lab.txt")")
    grep -E "^(PASS|FAIL)" "$LOG/gemm_lab.txt" | cut -c1-170
    cp "$LOG/gemm_lab.txt" "$OUT/" 2>/dev/null
  fi
  # the whole decode step at 4K, warm (dev/decode_step_profile.py: each step graph one ncu result)
  timeout 120 ncu --profile-from-start off --graph-profiling graph --cache-control none --clock-control none \
    --metrics "$NCU_METRICS" \
    --csv --page raw python3 dev/decode_step_profile.py --length 4096 > "$LOG/ncu_step.csv" 2> "$LOG/ncu_step.err"
  SUMMARY+=("ncu decode step rc=$?")
  python3 dev/ncu_table.py <(sed -n '/^"ID"/,$p' "$LOG/ncu_step.csv") --stalls 8 | tee "$OUT/ncu_step.md"
  cp "$LOG/check_decode.txt" "$LOG/check_sample.txt" "$OUT/" 2>/dev/null
  ;;
verify)  # every check of the build, and its speed against .h200/before, in one call (the header)
  envelope_start
  kernel_checks 300
  model_checks 150
  for cfg in tiny_odd tiny_dk_ne_dv; do memcheck_cfg $cfg; done
  mkdir -p /tmp/bsrc && cp -r src/lily /tmp/bsrc/ && cp .h200/before/_lily*.so /tmp/bsrc/lily/
  timeout 200 python3 dev/compare_builds.py --builds before=/tmp/bsrc,after=src --lengths 512,4096 --rounds 2 \
    --out "$OUT/compare_builds_h200.json" > "$LOG/compare.txt" 2>&1
  SUMMARY+=("compare_builds rc=$?"); tail -8 "$LOG/compare.txt"
  envelope_wait
  ;;
sanitize)  # racecheck alone on the GPU: 190 s on tiny_odd and 289 s on tiny_dk_ne_dv at 27376e1 (2026-12-02)
  for cfg in tiny_odd tiny_dk_ne_dv; do
    lim=230; [ $cfg = tiny_dk_ne_dv ] && lim=340
    timeout $lim "$CS" --tool racecheck --error-exitcode 9 python3 benchmarks/cuda_check.py --configs $cfg --tokens 12 \
      --progress --no-bundled > "$LOG/racecheck_$cfg.txt" 2>&1
    SUMMARY+=("racecheck $cfg rc=$? $(grep -m1 'RACECHECK SUMMARY\|ERROR SUMMARY' "$LOG/racecheck_$cfg.txt")")
    grep -E "^  |Race|Error" "$LOG/racecheck_$cfg.txt" | tail -4
    echo "[$(el)s] racecheck $cfg"
  done
  cp "$LOG"/racecheck_*.txt "$OUT/" 2>/dev/null
  ;;
trace)  # the decode step as it runs at LENGTHS (default 4096,131072): each launch's marginal time by role
        # (dev/decode_trace.py; the twelfth session's decode_in_situ_h200.md)
  timeout ${TRACE_TIMEOUT:-200} python3 dev/decode_trace.py --lengths ${LENGTHS:-4096,131072} --steps 8 \
    --json "$OUT/decode_trace_h200.json" > "$OUT/decode_trace_h200.txt" 2>&1
  SUMMARY+=("decode_trace rc=$?")
  grep -E "^(==|attn|dn_|moe|head|embed)" "$OUT/decode_trace_h200.txt"
  ;;
families)  # the decode step's time by kernel family at LENGTHS (default 4096,131072): every kernel of the greedy step
           # graph profiled alone (--graph-profiling node), warm caches (dev/decode_step_profile.py), families summed
  for L in $(echo ${LENGTHS:-4096,131072} | tr , ' '); do
    timeout ${FAMILY_TIMEOUT:-170} ncu --profile-from-start off --graph-profiling node --cache-control none --clock-control none \
      --metrics "$NCU_METRICS" \
      --csv --page raw python3 dev/decode_step_profile.py --length $L --steps 1 > "$LOG/ncu_node_$L.csv" 2> "$LOG/ncu_node_$L.err"
    SUMMARY+=("ncu node $L rc=$?")
    families_md "$LOG/ncu_node_$L.csv" "$OUT/ncu_step_families_$L.md"
    head -24 "$OUT/ncu_step_families_$L.md"
    echo "[$(el)s] families $L"
  done
  ;;
prefill_ncu)  # issue 15's ncu table by kernel family: each prefill launch profiled alone (dev/ncu_prefill.py), at 4K the
               # first N4K launches (default 100: layers 0-4, DeltaNet, attention and MoE), at 128K N128K launches
               # from SKIP128 (default 11600: inside the last 8192-row chunk, attention over ~120K keys); tensor TOP/s
               # from the tensor-path op counters (ncu_table.py --families), boost clock (--clock-control none)
  PM=$NCU_METRICS,sm__ops_path_tensor_src_bf16_dst_fp32.sum,sm__ops_path_tensor_src_tf32_dst_fp32.sum,sm__inst_executed_pipe_tensor_op_gmma.sum
  for spec in "4096 0 ${N4K:-100}" "131072 ${SKIP128:-11600} ${N128K:-80}"; do
    set -- $spec
    timeout ${PREFILL_NCU_TIMEOUT:-240} ncu --profile-from-start off --clock-control none --launch-skip $2 --launch-count $3 \
      --metrics "$PM" --csv --page raw python3 dev/ncu_prefill.py $1 > "$LOG/ncu_prefill_$1.csv" 2> "$LOG/ncu_prefill_$1.err"
    SUMMARY+=("ncu prefill $1 rc=$?")
    families_md "$LOG/ncu_prefill_$1.csv" "$OUT/ncu_prefill_families_$1.md"
    head -20 "$OUT/ncu_prefill_families_$1.md"
    echo "[$(el)s] prefill ncu $1"
  done
  ;;
sweep)  # the benchmark's full sweep (benchmarks/bench_cuda.py with the arguments after the mode), e.g.
        #   bash dev/h200_run.sh sweep --lengths 512,4096,32768,131072 --no-mlx --budget-s 400
  shift
  CK=/tmp/full35b
  [ -f $CK/config.json ] || python3 benchmarks/full_checkpoint.py $CK > "$LOG/full_checkpoint.txt" 2>&1
  timeout ${BENCH_TIMEOUT:-480} python3 benchmarks/bench_cuda.py --checkpoint $CK --out "$OUT" "$@" \
    > "$LOG/bench.txt" 2>&1
  SUMMARY+=("bench_cuda rc=$?")
  tail -30 "$LOG/bench.txt"
  ;;
bench)
  [ -d .before ] || { echo "no .before tree: see the header"; exit 1; }
  install_ext .before .h200/before build/h200_before || { echo "BEFORE BUILD FAILED"; exit 1; }
  echo "[$(el)s] before ready"
  timeout 330 python3 dev/compare_builds.py --builds before=.before/src,after=src --rounds 3 \
    --out "$OUT/compare_builds_h200.json" > "$LOG/compare_builds.txt" 2>&1
  SUMMARY+=("compare_builds rc=$?")
  tail -12 "$LOG/compare_builds.txt"
  echo "[$(el)s] compare_builds"
  CK=/tmp/full35b
  [ -f $CK/config.json ] || python3 benchmarks/full_checkpoint.py $CK > "$LOG/full_checkpoint.txt" 2>&1
  timeout 120 python3 benchmarks/bench_cuda.py --checkpoint $CK --lengths 512,4096 --no-mlx --no-ablations \
    --budget-s 100 --out "$LOG" --name bench_cuda_generate_h200 > "$LOG/bench_generate.txt" 2>&1
  SUMMARY+=("bench_cuda (generate rows) rc=$?")
  grep -iE "generate|decode" "$LOG/bench_generate.txt" | tail -8
  cp "$LOG"/bench_cuda_generate_h200.json "$OUT/" 2>/dev/null
  ;;
esac
