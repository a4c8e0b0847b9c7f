#!/usr/bin/env bash
# Build on the calling machine what dev/h200_run.sh runs on the H200, into the ignored folder .h200/ (carried):
# the extension for the device's Python (3.12 there; PY12 names an interpreter of that version here, with
# nanobind installed) from this tree (.h200/after) and from .before (.h200/before), the kernel check programs
# (.h200/kbin), gemv_lab (.h200/gemv_lab) the experiment
# (.h200/exp_deltanet_step) and the wgmma GEMM lab (.h200/gemm_lab). nvcc
# builds sm_90a code here as well as there; the device builds itself if a prebuilt extension does not import.
#   git archive 82eaca8 | (mkdir -p .before && tar -x -C .before)
#   PY12=~/.pyenv/versions/3.12.1/bin/python3 bash dev/h200_prebuild.sh [after|before|kbin|gemv_lab|exp|gemm_lab|wheels|bz ...]
set -euo pipefail
PY12=${PY12:-python3.12}
# the build folders are ignored here only (they travel when a run names them in carry, not with the tree)
mkdir -p .git/info
for d in /.h200/ /.before/ /.peer/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .h200
what=${*:-kbin gemv_lab exp gemm_lab after before}
ext() {  # ext SRC BUILD_DIR DEST
  [ -f "$2/build.ninja" ] || cmake -S "$1" -B "$2" -G Ninja -DPython_EXECUTABLE="$PY12" -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C "$2" -j"$(nproc)"
  mkdir -p "$3" && rm -f "$3"/_lily*.so && cp "$2"/_lily*.so "$3"/ && strip --strip-unneeded "$3"/_lily*.so
}
for w in $what; do
  case $w in
  after) ext . build/h200 .h200/after ;;
  before) ext .before build/h200_before .h200/before ;;
  kbin) BUILD_ONLY=1 KBIN=.h200/kbin OUT=/tmp/lily_kbuild bash benchmarks/kernels/run.sh ;;
  gemv_lab) BUILD_ONLY=1 BIN=.h200/gemv_lab bash dev/gemv_lab/run.sh | grep -v "^ *$" | tail -3 ;;
  exp) nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o .h200/exp_deltanet_step dev/exp_deltanet_step.cu ;;
  gemm_lab) nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o .h200/gemm_lab dev/gemm_lab/gemm_wgmma.cu ;;
  # the extensions and every kernel check program xz-compressed into .h200/bz (~11 MB against ~71: the 64 MiB a call
  # carries held the tree, two extensions and the check programs only this way); h200_run.sh verify unpacks them
  bz) mkdir -p .h200/bz
    for b in after before; do
      [ -f .h200/$b/_lily.cpython-312-x86_64-linux-gnu.so ] && xz -T0 -6 -c .h200/$b/_lily.cpython-312-x86_64-linux-gnu.so > .h200/bz/$b.so.xz
    done
    tar -cJf .h200/bz/kbin.tar.xz -C .h200/kbin . ;;
  # the server's and the openai client's packages, which the H200 image lacks (bench_cuda's lily-cuda-serve row), as
  # wheels for its Python 3.12 in .whl/ (carry it; h200_run.sh installs them): the closure of fastapi, uvicorn,
  # openai and llguidance over what the image holds, each once
  wheels) grep -qxF /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude
    "$PY12" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions \
      opentelemetry-api uvicorn click h11 openai httpx2 httpcore2 truststore idna anyio sniffio jiter certifi \
      llguidance ;;
  esac
done
du -sh .h200/*
