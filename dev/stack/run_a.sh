# Prepared 2026-12-04 (fourteenth session): call A of two. Correctness of the stacked builds and the trace of all6.
#   run: bash .h200/next/run_a.sh   (carry [".h200/next"]; ~5 min; built by dev/stack/build.sh)
# all5 = the tree + dev/exp_gemv_moe_own_routing.patch + exp_gemv_step_front.patch + exp_gemv_combine_front.patch
#        + exp_attention_prep_front.patch + exp_gemv_moe_one_launch.patch (133 launches a step);
# all6 = all5 + exp_gemv_own_prefetch_stacked.patch (each row group's later tiles into L2 with its first); before = the
# tree.
# kb.tar.xz: check_decode_fused5 / check_decode_fused6 (own routing, fronts, combine front, the MoE launch; 6 also
#   prefetches), check_decode6 (the GEMV's own cases, with the prefetch), check_attention and check_small of all4
#   (= all5, all6 there).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
L=/tmp/v; mkdir -p $L /tmp/kb /tmp/b_all5/lily
xz -dc .h200/next/all6.so.xz > src/lily/_lily.cpython-312-x86_64-linux-gnu.so
cp -r src/lily /tmp/b_all5/ && xz -dc .h200/next/all5.so.xz > /tmp/b_all5/lily/_lily.cpython-312-x86_64-linux-gnu.so
tar -xJf .h200/next/kb.tar.xz -C /tmp/kb
export PYTHONPATH=src
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
for n in check_decode_fused6 check_decode6 check_decode_fused5 check_attention check_small; do
  timeout 100 /tmp/kb/$n > $L/$n.txt 2>&1; echo "[$(el)s] $n rc=$? $(grep SUMMARY $L/$n.txt)"; grep -E "^FAIL" $L/$n.txt | head -8
done
# the MoE launch's other plan (the K part for the whole GPU, its later blocks started as row blocks end): build all6f
LILY_EXP_MOE_DOWN_FULL=1 timeout 100 /tmp/kb/check_decode_fused6 > $L/check_decode_fused6f.txt 2>&1
echo "[$(el)s] check_decode_fused6 (LILY_EXP_MOE_DOWN_FULL=1) rc=$? $(grep SUMMARY $L/check_decode_fused6f.txt)"; grep -E "^FAIL" $L/check_decode_fused6f.txt | head -8
grep -E "moe launch|counters" $L/check_decode_fused6.txt | head -24
timeout 150 python3 benchmarks/cuda_check.py --configs tiny,tiny_dk_ne_dv,tiny_odd,mid_real_heads --tokens 256 --no-bundled > $L/cuda_check.txt 2>&1
rc=$?; echo "[$(el)s] cuda_check all6 rc=$rc: $(tail -1 $L/cuda_check.txt)"; grep FAIL $L/cuda_check.txt | head
if [ $rc -ne 0 ]; then
  PYTHONPATH=/tmp/b_all5 timeout 100 python3 benchmarks/cuda_check.py --configs tiny,tiny_odd --tokens 128 --no-bundled > $L/cuda_check_all5.txt 2>&1
  echo "[$(el)s] cuda_check all5 rc=$?: $(tail -1 $L/cuda_check_all5.txt)"
fi
# the tree itself (before: the fused sub-blocks moved to decode_layers.cu in b653034, not yet run on a GPU)
mkdir -p /tmp/b_before && cp -r src/lily /tmp/b_before/ && xz -dc .h200/next/before.so.xz > /tmp/b_before/lily/_lily.cpython-312-x86_64-linux-gnu.so
PYTHONPATH=/tmp/b_before timeout 100 python3 benchmarks/cuda_check.py --configs tiny,tiny_odd --tokens 128 --no-bundled > $L/cuda_check_before.txt 2>&1
echo "[$(el)s] cuda_check before rc=$?: $(tail -1 $L/cuda_check_before.txt)"
timeout 60 "$CS" --tool memcheck --error-exitcode 9 python3 benchmarks/cuda_check.py --configs tiny_odd --tokens 12 --progress --no-bundled > $L/memcheck.txt 2>&1
echo "[$(el)s] memcheck rc=$? $(grep -m1 'ERROR SUMMARY' $L/memcheck.txt)"
timeout 90 "$CS" --tool racecheck --error-exitcode 9 python3 benchmarks/cuda_check.py --configs tiny_odd --tokens 6 --progress --no-bundled > $L/racecheck.txt 2>&1
echo "[$(el)s] racecheck rc=$? $(grep -i summary $L/racecheck.txt | tail -1)"
timeout 80 python3 dev/decode_trace.py --lengths 4096 --steps 8 --moe-launches 1 --json $OUT/decode_trace_all6_h200.json > $OUT/decode_trace_all6_h200.txt 2>&1
echo "[$(el)s] trace rc=$?"; grep -E "^(dn_|moe|attn|head|embed|==)" $OUT/decode_trace_all6_h200.txt
cp $L/*.txt $OUT/ 2>/dev/null
