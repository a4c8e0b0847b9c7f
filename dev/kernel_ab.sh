#!/usr/bin/env bash
# A/B of one CUDA kernel timing driver (benchmarks/kernels/time_NAME.cu) between a base revision and the working tree,
# in one device call. The driver and the sources on its "// build:" line are built from both trees with the same flags,
# run in alternating rounds (base, tree, tree, base, ...), and each TIME line's best time per build is printed with the
# ratio tree / base. The device has no git: `prepare` exports the base here, into .kernel_ab/ (git-ignored, so name it
# in the device call's `carry`).
#   bash dev/kernel_ab.sh prepare REV            (here) REV's csrc/ and benchmarks/kernels/ -> .kernel_ab/base
#   bash dev/kernel_ab.sh run NAME [ROUNDS]      (device, carry [".kernel_ab"]) default 2 rounds; $OUT gets the logs
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  rm -rf .kernel_ab/base && mkdir -p .kernel_ab/base
  git archive "${2:?REV}" csrc benchmarks/kernels | tar -x -C .kernel_ab/base
  git rev-parse --short "$2" > .kernel_ab/base/REV
  echo "base $(cat .kernel_ab/base/REV) in .kernel_ab/base"
  ;;
run)
  name=${2:?NAME}
  rounds=${3:-2}
  out=${OUT:-/tmp/kernel_ab}
  bin=/tmp/kernel_ab_bin
  mkdir -p "$out" "$bin"
  [ -d .kernel_ab/base ] || { echo "no .kernel_ab/base: run 'prepare REV' here and carry .kernel_ab"; exit 2; }
  flags="-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a"
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
  for side in base tree; do
    root=.; [ $side = base ] && root=.kernel_ab/base
    src=$root/benchmarks/kernels/time_$name.cu
    deps=$(sed -n 's#^// build: ##p' "$src" | head -1 | sed "s#csrc/#$root/csrc/#g")
    (nvcc $flags -I$root/csrc -I$root/benchmarks/kernels -o "$bin/$side" "$src" $deps > "$out/build_$side.txt" 2>&1 ||
      { echo "BUILD FAILED ($side)"; grep -m10 error "$out/build_$side.txt"; }) &
  done
  wait
  [ -x "$bin/base" ] && [ -x "$bin/tree" ] || exit 1
  for r in $(seq 1 "$rounds"); do
    order="base tree"; [ $((r % 2)) = 0 ] && order="tree base"
    for side in $order; do timeout 300 "$bin/$side" > "$out/${side}_$r.txt" 2>&1 || echo "$side round $r: rc $?"; done
  done
  python3 - "$out" "$(cat .kernel_ab/base/REV 2>/dev/null)" <<'PY'
import glob, re, sys
best = {"base": {}, "tree": {}}
order = []
for f in sorted(glob.glob(sys.argv[1] + "/*_[0-9]*.txt")):
    side = f.rsplit("/", 1)[1].split("_")[0]
    for line in open(f):
        m = re.match(r"TIME (.*?)\s+([\d.]+) us", line)
        if not m: continue
        key = re.sub(r"\s+", " ", m.group(1))
        key = re.sub(r" [\d.]+ MB \|", " |", key)
        if key not in order: order.append(key)
        best[side][key] = min(best[side].get(key, 1e30), float(m.group(2)))
print(f"| launch | base {sys.argv[2]} us | tree us | tree / base |")
print("|---|---:|---:|---:|")
for k in order:
    b, t = best["base"].get(k), best["tree"].get(k)
    fmt = lambda v: f"{v:.2f}" if v is not None else "-"
    print(f"| {k} | {fmt(b)} | {fmt(t)} | {t / b:.3f} |" if b and t else f"| {k} | {fmt(b)} | {fmt(t)} | - |")
PY
  ;;
*)
  sed -n 2,9p "$0"; exit 2 ;;
esac
