#!/usr/bin/env bash
# Builds on the calling machine what dev/stack/run_a.sh and run_b.sh run on the H200, into the ignored folder
# .h200/next/ (carry it: [".h200/next"], ~38 MB): the extension for the device's Python 3.12 (PY12: an interpreter of
# that version with nanobind) for each build of the issue-14 A/B, xz-compressed, and the kernel check programs.
#   PY12=~/.pyenv/versions/3.12.1/bin/python3 bash dev/stack/build.sh      (repository root, clean tree; ~10 min)
# Builds: before = the tree; pf = + dev/exp_gemv_own_prefetch.patch; pfh = pf with -DLILY_EXP_PF_HALF; the stack,
# cumulative: moe = + exp_gemv_moe_own_routing, both = + exp_gemv_step_front, all4 = + exp_gemv_combine_front +
# exp_attention_prep_front, all5 = + exp_gemv_moe_one_launch, all6 = + exp_gemv_own_prefetch_stacked.
# Kernel checks (kb.tar.xz): check_decode_fused5 (all5), check_decode6 and check_decode_fused6 (all6), check_attention
# and check_small (all4).
# It applies each patch set to the working tree, builds in build/h200 (incremental), then restores the tree
# (git checkout of csrc, benchmarks, docs): do not edit those while it runs.
set -euo pipefail
PY12=${PY12:-python3.12}
[ -z "$(git status --porcelain -- csrc benchmarks docs)" ] || { echo "csrc, benchmarks or docs have changes: commit them first"; exit 1; }
mkdir -p .git/info .h200/next /tmp/lily_stack
grep -qxF /.h200/ .git/info/exclude 2>/dev/null || echo /.h200/ >> .git/info/exclude
[ -f build/h200/build.ninja ] || cmake -S . -B build/h200 -G Ninja -DPython_EXECUTABLE="$PY12" -DCMAKE_BUILD_TYPE=Release >/dev/null
P=dev
S1="$P/exp_gemv_moe_own_routing.patch"; S2="$S1 $P/exp_gemv_step_front.patch"
S4="$S2 $P/exp_gemv_combine_front.patch $P/exp_attention_prep_front.patch"; S5="$S4 $P/exp_gemv_moe_one_launch.patch"
S6="$S5 $P/exp_gemv_own_prefetch_stacked.patch"
restore() {  # the patches' new files too
  git checkout -- csrc benchmarks docs
  rm -f csrc/cuda/gemv_front.cuh csrc/cuda/attention_prep.cuh benchmarks/kernels/check_decode_fused.cu
}
trap restore EXIT
KB=/tmp/lily_stack/kb; mkdir -p $KB
FLAGS="-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc"
kcheck() {  # kcheck NAME SOURCE: a kernel check program of the applied tree
  nvcc $FLAGS -o "$KB/$1" "benchmarks/kernels/$2.cu" $(sed -n 's#^// build: ##p' "benchmarks/kernels/$2.cu")
}
bld() {  # bld NAME [define] -- patches...
  local name=$1 def=$2; shift 2
  for p in "$@"; do git apply "$p"; done
  [ -n "$def" ] && sed -i "1i #define $def 1  // (build $name only)" csrc/cuda/gemv.cu
  ninja -C build/h200 > "/tmp/lily_stack/$name.log" 2>&1 || { tail -30 "/tmp/lily_stack/$name.log"; exit 1; }
  local so; so=$(ls build/h200/_lily*.so)
  strip --strip-unneeded -o "/tmp/lily_stack/$name.so" "$so"
  xz -T0 -6 -c "/tmp/lily_stack/$name.so" > ".h200/next/$name.so.xz"
  case $name in
    all4) kcheck check_attention check_attention; kcheck check_small check_small ;;
    all5) kcheck check_decode_fused5 check_decode_fused ;;
    all6) kcheck check_decode6 check_decode; kcheck check_decode_fused6 check_decode_fused ;;
  esac
  restore
  echo "built $name"
}
bld before ""
bld pf "" $P/exp_gemv_own_prefetch.patch
bld pfh LILY_EXP_PF_HALF $P/exp_gemv_own_prefetch.patch
bld moe "" $S1
bld both "" $S2
bld all4 "" $S4
bld all5 "" $S5
bld all6 "" $S6
tar -cJf .h200/next/kb.tar.xz -C $KB check_decode_fused5 check_decode6 check_decode_fused6 check_attention check_small
cp dev/stack/run_a.sh dev/stack/run_b.sh .h200/next/
du -sh .h200/next
