# Prepared 2026-12-05 (fifteenth session): call C of the issue-14 plan, after run_a.sh (checks) and run_b.sh (A/B):
# the acceptance sweep of the build that won, from its prebuilt extension, before it is landed (the landed tree has
# the same kernels; the JSON's git field says which build it was), then llama.cpp on the same machine.
#   here: mkdir -p .h200/c && rm -f .h200/c/* && cp .h200/next/<build>.so.xz .h200/c/
#   C1: LILY_GIT_SHA=<sha>+<build> bash dev/stack/run_c.sh sweep   (carry [".h200/c", ".whl"]; ~6 min)
#   C2: bash dev/stack/run_c.sh peer                                 (carry [".peer"]; ~5 min: 128K needs ~280 s)
# Two calls, back to back while the machine is warm (30 s): in one the thirteenth session's peer ran out of time
# during its 128K decode. Merge here: cd benchmarks/results && python3 ../bench_cuda.py --replot bench_cuda_h200.json
# --llamacpp-json llamacpp_h200.json.
set -u
export PYTHONUNBUFFERED=1
case ${1:-} in
sweep)
  B=$(ls .h200/c/*.so.xz 2>/dev/null | head -1)
  [ -n "$B" ] || { echo "no .h200/c/<build>.so.xz carried"; exit 1; }
  mkdir -p .h200/after && rm -f .h200/after/_lily*.so
  xz -dc "$B" > .h200/after/_lily.cpython-312-x86_64-linux-gnu.so
  echo "sweep of $(basename "$B" .so.xz) as ${LILY_GIT_SHA:-unknown}"
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-240} bash dev/h200_run.sh sweep --no-mlx --no-ablations --budget-s 200
  ;;
peer)
  LEAN=1 CHECK=0 UB=2048 PP=4096 DEPTHS=4096,131072 REPS=1 timeout 290 bash .peer/llamacpp/run_h200.sh
  ;;
*) echo "usage: bash dev/stack/run_c.sh sweep|peer"; exit 2 ;;
esac
