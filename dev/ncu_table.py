#!/usr/bin/env python3
"""Per-launch table from `ncu --csv --page raw` (units read from the CSV's units row, not assumed).
usage: ncu_table.py NCU_CSV [LABELS] [--stalls N] [--families]  -> markdown: label (or kernel), grid x block, us,
DRAM MB read, GB/s, DRAM % of peak, warps active %, registers, the top N stall reasons (default 2; share of PC
samples). LABELS: a file with one label per profiled launch, in launch order (optional).
--families: one row per kernel (template arguments dropped) instead: launches, total us and its share, DRAM MB,
GB/s over the family's time, the time-weighted DRAM % and warps active, the stall samples summed over its launches
(for `--graph-profiling node` of a step graph: the step's time by kernel family, each launch timed alone); where the
CSV holds the tensor-path op counters (sm__ops_path_tensor_*.sum, e.g. ncu over dev/ncu_prefill.py) also the
time-weighted SM throughput % and the tensor ops per second over the family's time (TOP/s)."""
import csv
import sys

TIME_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
BYTES_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "KB": 1e-3, "MB": 1.0, "GB": 1e3}
PRE = "smsp__pcsamp_warps_issue_stalled_"
OPS = "sm__ops_path_tensor_src_"  # tensor-path math ops by source / destination type (.sum counters)


def load(path):
    rd = list(csv.DictReader(open(path)))
    units = next((r for r in rd if not r.get("ID", "").strip()), {})
    rows = [r for r in rd if r.get("ID", "").strip().isdigit()]
    return rows, units


def num(r, k):
    try:
        return float(r.get(k, "nan").replace(",", ""))
    except ValueError:
        return float("nan")


def family(name):
    """The kernel without its return type, namespaces and arguments, template arguments kept (they are the launch
    kinds of one kernel): "void a::<unnamed>::k<0, 1>(Launch)" -> "k<0, 1>"."""
    depth, cut = 0, len(name)
    for i, c in enumerate(name):  # the argument list: the first '(' outside template brackets
        depth = max(0, depth + (c == "<") - (c == ">"))  # (ncu may cut a name inside "<unnamed>")
        if c == "(" and depth == 0:
            cut = i
            break
    head = name[:cut].strip()
    head = head[5:] if head.startswith("void ") else head
    depth, start = 0, 0
    for i, c in enumerate(head):  # the last '::' outside template brackets
        depth = max(0, depth + (c == "<") - (c == ">"))
        if depth == 0 and head.startswith("::", i):
            start = i + 2
    return head[start:] or name[:40]


def families(rows, tu, bu, n_stalls):
    fam = {}
    for r in rows:
        f = fam.setdefault(family(r.get("Kernel Name", "?")), {"n": 0, "us": 0.0, "mb": 0.0, "dram": 0.0, "warps": 0.0,
                                                               "sm": 0.0, "ops": 0.0, "st": {}})
        us = num(r, "gpu__time_duration.sum") * tu
        f["n"] += 1
        f["us"] += us
        f["mb"] += num(r, "dram__bytes_read.sum") * bu
        f["dram"] += us * num(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed")
        f["warps"] += us * num(r, "sm__warps_active.avg.pct_of_peak_sustained_active")
        f["sm"] += us * num(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
        f["ops"] += sum(num(r, k) for k in r if k.startswith(OPS) and num(r, k) == num(r, k))
        for k in r:
            if k.startswith(PRE) and "not_issued" not in k and num(r, k) == num(r, k):
                f["st"][k[len(PRE):]] = f["st"].get(k[len(PRE):], 0.0) + num(r, k)
    total = sum(f["us"] for f in fam.values()) or 1
    tensor = bool(rows) and any(k.startswith(OPS) for k in rows[0])
    print(f"{len(rows)} launches, {total:.1f} us summed (each launch timed alone)\n")
    extra = " SM % | tensor TOP/s |" if tensor else ""
    print("| kernel | launches | us | share | DRAM MB read | GB/s | DRAM % peak | warps active % |" + extra + " top stalls |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if tensor else "") + "---|")
    for name, f in sorted(fam.items(), key=lambda kv: -kv[1]["us"]):
        st = f["st"]
        tot = sum(st.values()) or 1
        top = sorted(((v, k) for k, v in st.items() if k != "selected"), reverse=True)[:n_stalls]
        tops = ", ".join(f"{k} {100 * v / tot:.0f}%" for v, k in top)
        us = f["us"] or 1
        cols = f" {f['sm'] / us:.1f} | {f['ops'] / us * 1e-6:.0f} |" if tensor else ""
        print(f"| {name} | {f['n']} | {f['us']:.1f} | {100 * f['us'] / total:.1f}% | {f['mb']:.1f} | "
              f"{f['mb'] * 1e3 / us:.0f} | {f['dram'] / us:.1f} | {f['warps'] / us:.1f} |{cols} {tops} |")


def main():
    argv = sys.argv[1:]
    n_stalls = 2
    by_family = "--families" in argv
    if by_family:
        argv.remove("--families")
    if "--stalls" in argv:
        i = argv.index("--stalls")
        n_stalls = int(argv[i + 1])
        del argv[i:i + 2]
    rows, units = load(argv[0])
    labels = [ln.strip() for ln in open(argv[1])] if len(argv) > 1 else []
    tu = TIME_US.get(units.get("gpu__time_duration.sum", "ns"), 1e-3)
    bu = BYTES_MB.get(units.get("dram__bytes_read.sum", "byte"), 1e-6)
    if by_family:
        families(rows, tu, bu, n_stalls)
        return
    print("| launch | grid x block | us | DRAM MB read | GB/s | DRAM % peak | warps active % | regs | top stalls |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(rows):
        us = num(r, "gpu__time_duration.sum") * tu
        mb = num(r, "dram__bytes_read.sum") * bu
        st = {k[len(PRE):]: num(r, k) for k in r if k.startswith(PRE) and "not_issued" not in k}
        tot = sum(v for v in st.values() if v == v) or 1
        top = sorted(((v, k) for k, v in st.items() if v == v and k != "selected"), reverse=True)[:n_stalls]
        tops = ", ".join(f"{k} {100 * v / tot:.0f}%" for v, k in top)
        name = labels[i] if i < len(labels) else r.get("Kernel Name", "?")[:40]
        grid = f"{r.get('Grid Size', '?')} x {r.get('Block Size', '?')}".replace(", 1, 1)", ")")
        print(f"| {name} | {grid} | {us:.2f} | {mb:.2f} | {mb * 1e3 / us if us else 0:.0f} | "
              f"{num(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} | "
              f"{num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | "
              f"{num(r, 'launch__registers_per_thread'):.0f} | {tops} |")


if __name__ == "__main__":
    main()
