#!/usr/bin/env python3
"""Per-kernel table from `ncu --csv --page raw` of `gemv_lab --profile` (run.sh with NCU=1).
usage: ncu_summary.py NCU_CSV LAB_STDOUT  -> markdown: shape, kernel, MB, us, GB/s, DRAM %, warps active %,
registers, top two stall reasons (share of PC samples). ncu rows and the lab's `profile-launch` lines are in the
same order (one launch per shape and kernel)."""
import csv
import sys

allrows = list(csv.DictReader(open(sys.argv[1])))
units = next((r for r in allrows if not r.get("ID", "").strip()), {})  # the units row
rows = [r for r in allrows if r.get("Kernel Name") and r["ID"].strip().isdigit()]
TIME_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
tu = TIME_US.get(units.get("gpu__time_duration.sum", "ns"), 1e-3)
lab = [ln.split()[1:] for ln in open(sys.argv[2]) if ln.startswith("profile-launch ")]
pre = "smsp__pcsamp_warps_issue_stalled_"


def num(r, k):
    try:
        return float(r.get(k, "nan").replace(",", ""))
    except ValueError:
        return float("nan")


print("| shape | kernel | MB | ncu us | GB/s | DRAM % peak | warps active % | regs | top stalls |")
print("|---|---|---:|---:|---:|---:|---:|---:|---|")
for r, (shape, kind, mb) in zip(rows, lab):
    us = num(r, "gpu__time_duration.sum") * tu
    st = {k[len(pre):]: num(r, k) for k in r if k.startswith(pre) and "not_issued" not in k}
    tot = sum(v for v in st.values() if v == v) or 1
    top = sorted(((v, k) for k, v in st.items() if v == v and k != "selected"), reverse=True)[:2]
    tops = ", ".join(f"{k} {100 * v / tot:.0f}%" for v, k in top)
    print(f"| {shape} | {kind} | {float(mb):.2f} | {us:.2f} | {float(mb) * 1e3 / us if us else 0:.0f} | "
          f"{num(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} | "
          f"{num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | "
          f"{num(r, 'launch__registers_per_thread'):.0f} | {tops} |")
if len(rows) != len(lab):
    print(f"\nwarning: {len(rows)} ncu rows, {len(lab)} lab launches")
