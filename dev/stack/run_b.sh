# Prepared 2026-12-04 (fourteenth session): call B of two. The A/B of the prepared patches.
#   run: bash .h200/next/run_b.sh   (carry [".h200/next"]; ~7-8 min, under the 10-minute limit; built by dev/stack/build.sh)
# builds (the extension for Python 3.12): before = the tree (ef8674a's kernels; the fused sub-blocks in decode_layers.cu since b653034); pf = the tree + exp_gemv_own_prefetch.patch;
#   pfh = pf built with LILY_EXP_PF_HALF (a launch that prefetches plans for half the block slots, so the next one is
#   resident beside it); the stack, cumulative: moe = + exp_gemv_moe_own_routing.patch, both = + exp_gemv_step_front.patch,
#   all4 = + exp_gemv_combine_front.patch + exp_attention_prep_front.patch, all5 = + exp_gemv_moe_one_launch.patch,
#   all6 = + exp_gemv_own_prefetch_stacked.patch, all6f = all6 with LILY_EXP_MOE_DOWN_FULL=1 (the MoE launch's down
#   planned for the whole GPU instead of the row part's free slots) (launches a step: 263, 263, 263, 223, 193, 173,
#   133, 133, 133)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
L=/tmp/v; mkdir -p $L
xz -dc .h200/next/all6.so.xz > src/lily/_lily.cpython-312-x86_64-linux-gnu.so
for v in before pf pfh moe both all4 all5; do mkdir -p /tmp/b_$v && cp -r src/lily /tmp/b_$v/ && xz -dc .h200/next/$v.so.xz > /tmp/b_$v/lily/_lily.cpython-312-x86_64-linux-gnu.so; done
export PYTHONPATH=src
echo "[$(el)s] unpacked"
timeout 480 python3 dev/compare_builds.py --builds "before=/tmp/b_before,pf=/tmp/b_pf,pfh=/tmp/b_pfh,moe=/tmp/b_moe,both=/tmp/b_both,all4=/tmp/b_all4,all5=/tmp/b_all5,all6=src,all6f=src|LILY_EXP_MOE_DOWN_FULL=1" --lengths 512,4096 --rounds 2 --keep-going --child-timeout 100 --out $OUT/compare_builds_h200.json > $L/compare.txt 2>&1
echo "[$(el)s] compare rc=$?"; grep -E "^round" $L/compare.txt | tail -3; tail -12 $L/compare.txt
cp $L/*.txt $OUT/ 2>/dev/null
