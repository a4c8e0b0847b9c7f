#!/usr/bin/env python3
"""Instructions per weight of each gemv_lab kernel's main loop, from `cuobjdump -sass` of the built binary.

The main loop is the backward branch whose body holds the most FFMAs; every kernel spends exactly one FFMA per
weight per lane (word_dot), so weights per lane per iteration = FFMA count and
    lane-instructions per weight = instructions in the loop body / FFMAs.
The budget at 70% of 4.8 TB/s is ~5.6 lane-instructions per weight (132 SMs x 4 schedulers x ~1.98 GHz issue,
0.5625 bytes per 4-bit weight); the INT pipe (LOP3/SHF/PRMT/IADD3) runs at half that rate on Hopper.
usage: sass_count.py BINARY [--dump SUBSTRING]   (cuobjdump, nvdisasm on PATH: pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm provides both where the toolkit lacks them; --dump prints the loop of matching kernels)
"""
import collections
import os
import re
import subprocess
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def functions(sass):
    cur, body = None, []
    for ln in sass.splitlines():
        m = re.search(r"Function : (\S+)", ln)
        if m:
            if cur:
                yield cur, body
            cur, body = m.group(1), []
            continue
        m = LINE.search(ln)
        if m and cur:
            body.append((int(m.group(1), 16), m.group(3), m.group(4)))
    if cur:
        yield cur, body


def main_loop(body):
    best = None
    for addr, op, args in body:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", args)
            if t and int(t.group(1), 16) < addr:
                lo = int(t.group(1), 16)
                ins = [b for b in body if lo <= b[0] <= addr]
                ffma = sum(1 for b in ins if b[1].startswith("FFMA"))
                if best is None or ffma > best[0]:
                    best = (ffma, ins)
    return best


def main():
    exe = os.environ.get("CUOBJDUMP", "cuobjdump")
    dump = sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv else None
    sass = subprocess.run([exe, "-sass", sys.argv[1]], check=True, capture_output=True, text=True).stdout
    print("| kernel | loop instr | FFMA (= weights/lane) | instr / 32 weights | instr / weight | INT-pipe / weight | mix |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, body in functions(sass):
        best = main_loop(body)
        if not best or best[0] == 0:
            continue
        ffma, ins = best
        if dump and dump in name:
            for a, op, args in ins:
                print(f"  {a:05x} {op}{args}")
        mix = collections.Counter(op.split(".")[0] for _, op, _ in ins)
        intp = sum(mix[k] for k in ("LOP3", "SHF", "PRMT", "IADD3", "IMAD", "LEA", "SEL", "ISETP", "IMNMX"))
        top = ", ".join(f"{k} {v}" for k, v in mix.most_common(9))
        print(f"| {name} | {len(ins)} | {ffma} | {32 * len(ins) / ffma:.1f} | {len(ins) / ffma:.2f} | "
              f"{intp / ffma:.2f} | {top} |")


if __name__ == "__main__":
    main()
