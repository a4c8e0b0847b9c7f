#!/usr/bin/env bash
# Build gemv_lab, report the main loops' SASS instructions per weight, run it.
#   bash dev/gemv_lab/run.sh [gemv_lab args]      e.g. --shape dn_in,lm_head --kernel stream,read
#   BUILD_ONLY=1 bash dev/gemv_lab/run.sh          compile + SASS count only (no GPU needed)
#   CPU_ONLY=1 bash dev/gemv_lab/run.sh            compile + the --cpu-only self-test (no GPU needed)
#   PREBUILT=1 BIN=path bash dev/gemv_lab/run.sh   run a binary built elsewhere (no nvcc)
#   NCU=1 bash dev/gemv_lab/run.sh [--shape ...]   Nsight Compute, one launch per shape and kernel: raw CSV to
#                                                  ${OUT:-/tmp}/gemv_lab_ncu.csv, table by ncu_summary.py
# Output goes to stdout and, when $OUT is set (the device machine), to $OUT/gemv_lab.txt.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${BIN:-/tmp/gemv_lab_build/gemv_lab}
mkdir -p "$(dirname "$bin")"
log=${OUT:+$OUT/gemv_lab.txt}
log=${log:-/dev/null}
{
  echo "== build (git $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?'))"
  # -Xptxas -v: registers and spills per kernel (the build must show 0 bytes spill for every gemv_stream)
  # PREBUILT=1 with BIN=path: run a binary built on another machine (BUILD_ONLY=1 there), no nvcc here
  [[ -n "${PREBUILT:-}" && -x "$bin" ]] || nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -Xcompiler -Wall,-Wextra \
    -o "$bin" "$here/gemv_lab.cu" 2>&1 | grep -E "Compiling entry|Used|spill|warning|error" | paste - - - |
    sed -E 's/ptxas info *: //g; s/Compiling entry function //; s/Function properties for [^ ]*//'
  if command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null; then
    echo "== SASS: main loop instructions per weight (sass_count.py)"
    python3 "$here/sass_count.py" "$bin"
  else
    echo "== SASS count skipped: cuobjdump/nvdisasm not on PATH (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
  fi
  if [[ -n "${BUILD_ONLY:-}" ]]; then exit 0; fi
  if [[ -n "${CPU_ONLY:-}" ]]; then "$bin" --cpu-only; exit $?; fi
  if [[ -n "${NCU:-}" ]]; then
    stalls=$(echo smsp__pcsamp_warps_issue_stalled_{long_scoreboard,lg_throttle,wait,no_instructions,math_pipe_throttle,short_scoreboard,mio_throttle,barrier,not_selected,selected,dispatch_stall,branch_resolving,drain,imc_miss,membar,misc,sleeping,tex_throttle} | tr ' ' ,)
    csv=${OUT:-/tmp}/gemv_lab_ncu.csv
    # --cache-control all: L2 flushed before every profiled launch (cold weights, like the decode step)
    ncu --clock-control none --cache-control all --kernel-name regex:'gemv_stream|read_kernel' \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,"$stalls" \
      -f -o /tmp/gemv_lab_ncu "$bin" --profile "$@" > /tmp/gemv_lab_profile.txt
    ncu -i /tmp/gemv_lab_ncu.ncu-rep --csv --page raw > "$csv"
    [[ -n "${OUT:-}" ]] && cp /tmp/gemv_lab_ncu.ncu-rep "$OUT/" || true
    grep -E "profile-launch|PASS|FAIL" /tmp/gemv_lab_profile.txt | tail -3
    python3 "$here/ncu_summary.py" "$csv" /tmp/gemv_lab_profile.txt
    exit 0
  fi
  "$bin" --cpu-only
  echo "== GPU"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>/dev/null || true
  "$bin" "$@"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
