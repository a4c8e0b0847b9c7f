#!/usr/bin/env python3
"""mslc: check and build Metal (.metal) compute kernels on Linux through the MSL-as-C++ shim.

  mslc.py lint     F.metal   kernel-signature and portability rules (regex, no compiler)
  mslc.py check    F.metal   g++ -fsyntax-only -nostdinc against include/metal_stdlib (types, const, vectors)
  mslc.py check3   F.metal   the same as a Metal 3.1 compiler (no __HAVE_TENSOR__, no <metal_tensor>)
  mslc.py check-as F.metal   clang++ in C++-for-OpenCL mode: address spaces are real qualifiers
  mslc.py build    F.metal   shared library with one launcher per kernel (host name), for emu.py / ctypes
  mslc.py build-embedded F.metal...  the same for self-contained texts (the backend's runtime compile)
  mslc.py all      F.metal   lint + check + check-as

Project headers included with quotes are inlined (with #line markers) so the MSL rewrites below apply to
them too; <metal_*> headers resolve to include/. Source lines stay 1:1, so diagnostics point at the
.metal file. Rewrites: `1.0h` literals, kernel-scope `threadgroup` declarations (exec: per-threadgroup
storage, poisoned), `[[function_constant(i)]]` (exec: read at dispatch from a table the harness fills),
`template [[host_name("x")]] [[kernel]] decltype(f<..>) f<..>;` instantiations (attributes dropped).
Outputs are cached under $MSL_BUILD_DIR (default <repo>/build/msl) by a hash of everything that feeds them.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
INC = os.path.join(HERE, "include")
RT_SRC = os.path.join(HERE, "rt", "msl_rt.cpp")
DEFAULT_INCLUDES = [os.path.join(REPO, "metal"), os.path.join(REPO, "csrc")]
PARAMS_H = os.path.join(REPO, "csrc", "kernels", "params.h")


def clang_command() -> list[str] | None:
    """The clang driver of the address-space and Objective-C++ checks: $MSL_CLANG (a command line) if set,
    else the clang inside the `ziglang` wheel (a test dependency, so `pip install` is enough: `zig clang` is
    zig's unmodified clang driver; -resource-dir points it at its own builtin headers), else clang++-16 or
    clang++ on PATH. None when there is none."""
    if os.environ.get("MSL_CLANG"):
        return shlex.split(os.environ["MSL_CLANG"])
    spec = importlib.util.find_spec("ziglang")
    if spec and spec.origin:
        zig_dir = os.path.dirname(spec.origin)
        zig = os.path.join(zig_dir, "zig.exe" if os.name == "nt" else "zig")
        if os.path.exists(zig):
            return [zig, "clang", "-resource-dir", os.path.join(zig_dir, "lib")]
    for name in ("clang++-16", "clang++"):
        if shutil.which(name):
            return [name]
    return None


CLANG = clang_command()
CLANG_MISSING = ("no clang found for the address-space check: pip install ziglang (listed in tests/requirements.txt), "
                 "or set MSL_CLANG to a clang++ command line")


def build_dir() -> str:
    d = os.environ.get("MSL_BUILD_DIR") or os.path.join(REPO, "build", "msl")
    os.makedirs(d, exist_ok=True)
    return d


# ------------------------------------------------------------------ source handling

def strip_comments(src: str) -> str:
    """Comments -> spaces (newlines kept, so offsets and line numbers survive); strings kept."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j])); i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1]); i = j + 1
        else:
            out.append(c); i += 1
    return "".join(out)


def inline_includes(path: str, include_dirs=None, _seen=None) -> tuple[str, list[str]]:
    """Text of path with `#include "x"` inlined recursively (#pragma once honoured), plus the files read."""
    include_dirs = list(DEFAULT_INCLUDES if include_dirs is None else include_dirs)
    seen = _seen if _seen is not None else set()
    path = os.path.abspath(path)
    files = [path]
    if path in seen:
        return "", files
    src = open(path).read()
    if re.search(r"^\s*#\s*pragma\s+once", src, re.M):
        seen.add(path)
    out = []
    for n, line in enumerate(src.split("\n"), 1):
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if not m:
            out.append("" if re.match(r"\s*#\s*pragma\s+once", line) else line)
            continue
        for d in [os.path.dirname(path)] + include_dirs:
            cand = os.path.join(d, m.group(1))
            if os.path.exists(cand):
                break
        else:
            raise FileNotFoundError(f"{path}:{n}: include \"{m.group(1)}\" not found")
        body, sub = inline_includes(cand, include_dirs, seen)
        files += sub
        out.append(f'#line 1 "{os.path.abspath(cand)}"\n{body}\n#line {n + 1} "{path}"')
    return "\n".join(out), files


def split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([<{": depth += 1
        elif ch in ")]>}": depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur); cur = ""
        else:
            cur += ch
    if cur.strip(): parts.append(cur)
    return parts


KERNEL = re.compile(r"(?:\bkernel\b|\[\[\s*kernel\s*\]\])\s+void\s+([A-Za-z_]\w*)\s*\(")
INST = re.compile(r'template\s*\[\[\s*host_name\(\s*"(\w+)"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*'
                  r"decltype\(\s*(\w+)\s*<([^;]*?)>\s*\)\s*(\w+)\s*<([^;]*?)>\s*;")
FCONST = re.compile(r"^([ \t]*)constant\s+([\w:]+)\s+(\w+)\s*\[\[\s*function_constant\(\s*(\d+)\s*\)\s*\]\]\s*;", re.M)
TG_DECL = re.compile(r"^(\s*)threadgroup\s+([A-Za-z_][\w:<>,\s]*?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]\n]*\]\s*)*);", re.M)


def parse(src: str) -> dict:
    """Kernels (name, params [(decl, attr)], line, is_template, max_threads), instantiations, function constants."""
    code = strip_comments(src)
    kernels = {}
    for m in KERNEL.finditer(code):
        i, depth = m.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0); i += 1
        params = []
        for p in split_top(code[m.end():i - 1]):
            a = re.search(r"\[\[\s*([^\]]*?)\s*\]\]", p)
            decl = " ".join(re.sub(r"\[\[.*?\]\]", "", p).split())
            params.append((decl, a.group(1) if a else None))
        before = code[max(0, m.start() - 400):m.start()]
        mt = re.search(r"max_total_threads_per_threadgroup\(\s*(\d+)\s*\)\s*\]\]\s*$", before)
        kernels[m.group(1)] = dict(name=m.group(1), params=params, line=code.count("\n", 0, m.start()) + 1,
                                   template=bool(re.search(r"template\s*<[^;{}]*>\s*(?:\[\[[^\]]*\]\]\s*)*$", before)),
                                   max_threads=int(mt.group(1)) if mt else 1024)
    insts = [dict(host=m.group(1), func=m.group(2), args=" ".join(m.group(3).split()),
                  line=code.count("\n", 0, m.start()) + 1, func2=m.group(4), args2=" ".join(m.group(5).split()))
             for m in INST.finditer(code)]
    fcs = [dict(type=m.group(2), name=m.group(3), index=int(m.group(4)), line=code.count("\n", 0, m.start()) + 1)
           for m in FCONST.finditer(code)]
    return dict(kernels=kernels, insts=insts, fcs=fcs)


def entry_points(info: dict) -> dict:
    """host name -> (kernel dict, call expression) for every launchable kernel."""
    eps = {}
    for k in info["kernels"].values():
        if not k["template"]:
            eps[k["name"]] = (k, k["name"])
    for ins in info["insts"]:
        k = info["kernels"].get(ins["func"])
        if k is not None:
            eps[ins["host"]] = (k, f"{ins['func']}<{ins['args']}>")
    return eps


# ------------------------------------------------------------------ lint

BUILTINS = {  # attribute -> launcher expression
    "thread_position_in_grid": "c->thread_position_in_grid",
    "thread_position_in_threadgroup": "c->thread_position_in_threadgroup",
    "threadgroup_position_in_grid": "c->threadgroup_position_in_grid",
    "threads_per_threadgroup": "c->threads_per_threadgroup",
    "dispatch_threads_per_threadgroup": "c->threads_per_threadgroup",
    "threadgroups_per_grid": "c->threadgroups_per_grid",
    "threads_per_grid": "c->threads_per_grid",
    "thread_index_in_threadgroup": "&c->thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "&c->thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "&c->simdgroup_index_in_threadgroup",
    "threads_per_simdgroup": "&c->threads_per_simdgroup",
    "thread_execution_width": "&c->threads_per_simdgroup",
    "simdgroups_per_threadgroup": "&c->simdgroups_per_threadgroup",
}
VEC_BUILTINS = {"thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
                "threads_per_threadgroup", "dispatch_threads_per_threadgroup", "threadgroups_per_grid",
                "threads_per_grid"}
INT_TYPES = {"uint", "ushort", "uint32_t", "uint16_t"}
VEC_INT_TYPES = {"uint2", "uint3", "ushort2", "ushort3"}


def metal_lines(code: str):
    """(line number, text) of the lines a Metal compiler sees: branches of `#if[n]def __METAL_VERSION__`
    (and `#if [!]defined(__METAL_VERSION__)`) that are off under Metal are skipped; other #if are kept."""
    stack = []  # per open #if: True / False (Metal branch on/off) or None (not about Metal)
    for n, line in enumerate(code.split("\n"), 1):
        d = re.match(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b(.*)", line)
        if d:
            kw, rest = d.group(1), d.group(2)
            if kw in ("ifdef", "ifndef", "if"):
                about = "__METAL_VERSION__" in rest
                neg = kw == "ifndef" or (kw == "if" and re.search(r"!\s*defined", rest) is not None)
                stack.append((not neg) if about else None)
            elif kw == "else" and stack and stack[-1] is not None:
                stack[-1] = not stack[-1]
            elif kw == "endif" and stack:
                stack.pop()
            continue
        if all(s is not False for s in stack):
            yield n, line


def lint(src: str, path: str) -> list[str]:
    errs = []
    code = strip_comments(src)
    for n, line in metal_lines(code):
        if re.search(r"\bdouble\b", line): errs.append(f"{path}:{n}: error: 'double' is not supported in MSL")
        if "std::" in line: errs.append(f"{path}:{n}: error: the C++ standard library is not available in MSL")
        if re.search(r"\b(printf|malloc|free)\s*\(|\bnew\s+[A-Za-z_]|\bdelete\s+[A-Za-z_]", line):
            errs.append(f"{path}:{n}: error: dynamic allocation and printf are not available in MSL")
        if re.search(r"\bthrow\b|\btry\s*\{|\bdynamic_cast\b|\btypeid\b|\bvirtual\b", line):
            errs.append(f"{path}:{n}: error: exceptions, RTTI and virtual functions are not available in MSL")
        if re.match(r"\s*threadgroup\s+[^;()=]*\]\s*,", line):
            errs.append(f"{path}:{n}: error: declare one threadgroup variable per statement")
        if re.search(r"#\s*include\s*<(?!metal_|MetalPerformancePrimitives/MetalPerformancePrimitives\.h>)", line):
            errs.append(f"{path}:{n}: error: only <metal_*> and <MetalPerformancePrimitives/...> system headers "
                        f"exist in MSL")
    info = parse(src)
    hosts = {}
    for ins in info["insts"]:
        if ins["host"] in hosts: errs.append(f"{path}:{ins['line']}: error: host_name '{ins['host']}' used twice")
        hosts[ins["host"]] = ins
        if ins["func"] != ins["func2"] or ins["args"] != ins["args2"]:
            errs.append(f"{path}:{ins['line']}: error: instantiation names {ins['func']}<{ins['args']}> and "
                        f"{ins['func2']}<{ins['args2']}> differ")
        k = info["kernels"].get(ins["func"])
        if k is None or not k["template"]:
            errs.append(f"{path}:{ins['line']}: error: host_name '{ins['host']}' instantiates '{ins['func']}', "
                        f"which is not a template kernel")
    for k in info["kernels"].values():
        if k["template"] and not any(i["func"] == k["name"] for i in info["insts"]):
            errs.append(f"{path}:{k['line']}: error: template kernel '{k['name']}' has no [[host_name]] instantiation")
        seen = {}
        for decl, attr in k["params"]:
            where = f"{path}:{k['line']}: kernel '{k['name']}', parameter '{decl}'"
            if attr is None:
                errs.append(f"{where}: error: kernel parameter without attribute"); continue
            am = re.match(r"(\w+)\s*(?:\(\s*(\d+)\s*\))?", attr)
            kind, idx = am.group(1), am.group(2)
            if kind in ("buffer", "threadgroup"):
                if "*" not in decl and "&" not in decl:
                    errs.append(f"{where}: error: [[{kind}(n)]] needs a pointer or reference")
                else:
                    head = re.split(r"[*&]", decl)[0]
                    sp = {"device", "constant", "threadgroup"} & set(re.findall(r"\w+", head))
                    if not sp: errs.append(f"{where}: error: pointer/reference kernel argument needs an address space")
                    if kind == "threadgroup" and sp != {"threadgroup"}:
                        errs.append(f"{where}: error: [[threadgroup(n)]] needs a threadgroup pointer")
                    if kind == "buffer" and "threadgroup" in sp:
                        errs.append(f"{where}: error: [[buffer(n)]] cannot be a threadgroup pointer")
                if idx is None or int(idx) > 30:
                    errs.append(f"{where}: error: [[{kind}(n)]] index must be 0..30")
                key = (kind, idx)
                if key in seen: errs.append(f"{where}: error: {kind}({idx}) already used by '{seen[key]}'")
                seen[key] = decl
            elif kind in BUILTINS:
                toks = decl.replace("const ", "").split()
                ty = toks[-2] if len(toks) >= 2 else "?"
                ok = ty in INT_TYPES or (kind in VEC_BUILTINS and ty in VEC_INT_TYPES)
                if not ok: errs.append(f"{where}: error: [[{kind}]] must be uint/ushort"
                                       f"{' (or uint2/uint3)' if kind in VEC_BUILTINS else ''}, not '{ty}'")
            else:
                errs.append(f"{where}: error: unsupported attribute [[{attr}]]")
    idx = {}
    for fc in info["fcs"]:
        if fc["index"] in idx:
            errs.append(f"{path}:{fc['line']}: error: function_constant({fc['index']}) already used by '{idx[fc['index']]}'")
        idx[fc["index"]] = fc["name"]
        if fc["type"] not in ("bool", "int", "uint", "short", "ushort", "float", "int32_t", "uint32_t"):
            errs.append(f"{path}:{fc['line']}: error: function constant type '{fc['type']}' not supported")
    return errs


# ------------------------------------------------------------------ params.h structs

def parse_structs(path: str = PARAMS_H) -> dict[str, list[tuple[str, str, int]]]:
    """struct name -> [(type, field, array_len)] for the POD structs of params.h (namespace lily::kp)."""
    code = strip_comments(open(path).read())
    out = {}
    for m in re.finditer(r"\bstruct\s+(\w+)\s*\{([^}]*)\}\s*;", code):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl: continue
            dm = re.match(r"(\w+)\s+(.+)$", decl)
            ty = dm.group(1)
            for name in dm.group(2).split(","):
                nm = re.match(r"\s*(\w+)\s*(?:\[\s*(\d+)\s*\])?\s*$", name)
                fields.append((ty, nm.group(1), int(nm.group(2) or 0)))
        out[m.group(1)] = fields
    return out


# ------------------------------------------------------------------ translation units

def rewrite_literals(src: str) -> str:
    num = r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)"
    src = re.sub(num + r"h\b", r"half(\1)", src)
    return re.sub(num + r"bf\b", r"bfloat(\1)", src)


def rewrite(src: str, mode: str, info: dict) -> str:
    src = rewrite_literals(src)
    src = INST.sub(lambda m: f"template decltype({m.group(2)}<{m.group(3)}>) {m.group(4)}<{m.group(5)}>;", src)

    # exec/check: every use reads the table the harness fills per dispatch, and reports a constant the
    # pipeline did not set (Metal refuses to build such a pipeline).
    def fc(m):
        ind, ty, name, i = m.groups()
        return f"{ind}constant {ty} {name} = {ty}();" if mode == "as" else f"{ind}/* function constant {name} */"
    src = FCONST.sub(fc, src)
    for f in info["fcs"]:
        repl = "true" if mode == "as" else f"(__msl_fc_defined[{f['index']}] != 0)"
        src = re.sub(r"\bis_function_constant_defined\(\s*" + f["name"] + r"\s*\)", repl, src)
        if mode != "as":
            src = re.sub(r"(?<![.\w>])" + f["name"] + r"\b(?!\s*\[\[)", f"__msl_fc_get<{f['type']}>({f['index']})", src)

    def tg(m):
        ind, ty, name, dims = m.groups()
        if mode == "as":  # a reference into threadgroup storage keeps the declared type
            return f"{ind}threadgroup {ty} (&{name}){dims} = *(threadgroup {ty} (*){dims})msl_tg_region();"
        return (f"{ind}static thread_local {ty} {name}{dims}; static thread_local unsigned {name}__ep = 0u; "
                f"msl_rt_tg_poison(&{name}, sizeof({name}), &{name}__ep);")
    return TG_DECL.sub(tg, src)


def launchers(info: dict, structs: dict) -> str:
    gen = ['#include "msl_launch.h"',
           'extern "C" { unsigned long long __msl_fc[64]; unsigned char __msl_fc_defined[64]; }']
    for host, (k, call) in entry_points(info).items():
        args = []
        for i, (decl, attr) in enumerate(k["params"]):
            P = f"typename msl::launch::param<decltype({call}), {i}>::type"
            kind, idx = re.match(r"(\w+)\s*(?:\(\s*(\d+)\s*\))?", attr or "x").groups()
            if kind == "buffer": args.append(f"msl::launch::buf<{P}>::get(b[{idx}])")
            elif kind == "threadgroup": args.append(f"({P})tg[{idx}]")
            elif kind in BUILTINS:
                f = BUILTINS[kind]
                args.append(f"msl::launch::bi<{P}>::get({f})")
            else: args.append(f"/* unsupported [[{attr}]] */")
        # per [[buffer(i)]]: 'r' read-only (const / constant), 'w' written, '-' unused (hazard checks)
        acc = {}
        for decl, attr in k["params"]:
            bm = re.match(r"buffer\(\s*(\d+)\s*\)", attr or "")
            if bm:
                head = re.split(r"[*&]", decl)[0].split()
                acc[int(bm.group(1))] = "r" if ("const" in head or "constant" in head) else "w"
        access = "".join(acc.get(i, "-") for i in range(max(acc) + 1)) if acc else ""
        gen.append(f'extern "C" const char __msl_access_{host}[] = "{access}";')
        gen.append(f'extern "C" void __msl_launch_{host}(void** b, void** tg) {{\n'
                   f"  const msl_thread_ctx* c = msl_rt_ctx(); (void)c; (void)tg; (void)b;\n"
                   f"  {call}(" + ",\n    ".join(args) + ");\n}")
    for name, fields in structs.items():  # host/device layout agreement, checked by emu.py
        offs = ", ".join(f"__builtin_offsetof(lily::kp::{name}, {f})" for _, f, _ in fields)
        gen.append(f'extern "C" const unsigned long __msl_layout_{name}[] = {{sizeof(lily::kp::{name}), {offs}}};')
    return "\n".join(gen) + "\n"


FC_DECL = ('extern "C" { extern unsigned long long __msl_fc[64]; extern unsigned char __msl_fc_defined[64]; }\n'
           'template<class T> inline T __msl_fc_get(int i) { if (!__msl_fc_defined[i]) '
           'msl_rt_report("a function constant used by the kernel was not set"); '
           'T v; __builtin_memcpy(&v, &__msl_fc[i], sizeof(T)); return v; }\n')


def generate(path: str, mode: str, include_dirs=None) -> tuple[str, list[str]]:
    """mode: 'exec' (build), 'check' (g++ syntax), 'as' (clang OpenCL). Returns (TU text, files read)."""
    text, files = inline_includes(path, include_dirs)
    info = parse(text)
    body = rewrite(text, mode, info)
    path = os.path.abspath(path)
    head = "" if mode == "as" else FC_DECL
    tu = head + f'#line 1 "{path}"\n' + body
    if mode == "exec":
        used = {s: f for s, f in parse_structs().items() if re.search(r"\b" + s + r"\b", text)} \
            if os.path.exists(PARAMS_H) else {}
        tu += f'\n#line 1 "{os.path.basename(path)}.launchers"\n' + launchers(info, used)
    return tu, files


def run(cmd: list[str]) -> tuple[int, str]:
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


WARN = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-variable", "-Wno-attributes",
        "-Wno-unused-but-set-variable", "-Werror=double-promotion", "-Werror=return-type"]
GXX = ["g++", "-std=c++17", "-nostdinc", "-nostdinc++", "-fno-exceptions", "-fno-rtti", "-I", INC,
       "-include", "metal_stdlib"]
CLANG_FLAGS = ["-cl-std=clc++2021", "-cl-no-stdinc", "-nostdinc", "-I", INC, "-include", "metal_stdlib",
               "-Wno-unknown-attributes", "-Wno-gnu-anonymous-struct", "-Wno-nested-anon-types"]


def _key(*parts) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
    for d, dirs, files in sorted(os.walk(INC)):
        dirs.sort()
        for f in sorted(files):
            h.update(os.path.relpath(os.path.join(d, f), INC).encode())
            h.update(open(os.path.join(d, f), "rb").read())
    return h.hexdigest()[:16]


def _cached(tag: str, path: str, mode: str, cmd_of, include_dirs=None) -> tuple[int, str]:
    tu, _ = generate(path, mode, include_dirs)
    base = os.path.join(build_dir(), f"{os.path.basename(path)}.{tag}.{_key(tu, tag, ' '.join(cmd_of('X')))}")
    if os.path.exists(base + ".rc"):
        return int(open(base + ".rc").read()), open(base + ".log").read()
    src = base + ".cpp"
    open(src, "w").write(tu)
    rc, out = run(cmd_of(src))
    open(base + ".log", "w").write(out)
    open(base + ".rc", "w").write(str(rc))
    return rc, out


def check(path: str, include_dirs=None, metal3: bool = False) -> tuple[int, str]:
    """g++ against the shim. metal3: as a Metal 3.1 compiler (-std=metal3.0: no tensor types), which is how
    csrc/metal/metal.cmake builds every file but the tensor-op one."""
    flags = ["-DMSL_SHIM_METAL3"] if metal3 else []
    return _cached("check3" if metal3 else "check", path, "check",
                   lambda s: GXX + flags + WARN + ["-fsyntax-only", "-x", "c++", s], include_dirs)


def check_as(path: str, include_dirs=None) -> tuple[int, str]:
    if CLANG is None:
        return 1, CLANG_MISSING
    return _cached("as", path, "as", lambda s: CLANG + CLANG_FLAGS + ["-fsyntax-only", "-x", "clcpp", s], include_dirs)


def runtime_lib() -> str:
    """Builds (once) the shared runtime every kernel library links against."""
    rt = open(RT_SRC).read()
    # One runtime per process whatever folder a library was built in: the SONAME makes the loader reuse an
    # already loaded runtime of the same source (emu.py loads it RTLD_GLOBAL; kernel libraries built in the
    # runtime-compile cache would otherwise bring a second copy, and a kernel would reach the other copy's
    # per-thread context).
    name = f"libmsl_rt.{_key(rt, 'soname')}.so"
    # ... and one file for every build folder (the runtime-compile cache sets MSL_BUILD_DIR to its own): two files
    # of the same runtime loaded by path are two copies to the loader, SONAME or not.
    rt_dir = os.environ.get("MSL_RT_DIR") or os.path.join(REPO, "build", "msl")
    os.makedirs(rt_dir, exist_ok=True)
    so = os.path.join(rt_dir, name)
    if not os.path.exists(so):
        tmp = so + f".{os.getpid()}.tmp"
        rc, out = run(["g++", "-std=c++17", "-O2", "-fPIC", "-shared", RT_SRC, "-o", tmp, "-lpthread",
                       f"-Wl,-soname,{name}"])
        if rc:
            raise RuntimeError("msl runtime build failed:\n" + out)
        os.replace(tmp, so)
    return so


def build(path: str, include_dirs=None, opt: str = "-O2") -> tuple[int, str, str | None]:
    """-> (rc, compiler output, path of the kernel library)."""
    rt = runtime_lib()
    tu, _ = generate(path, "exec", include_dirs)
    base = os.path.join(build_dir(), f"{os.path.basename(path)}.exec.{_key(tu, opt, rt)}")
    so = base + ".so"
    if os.path.exists(so):
        return 0, "", so
    open(base + ".cpp", "w").write(tu)
    tmp = so + f".{os.getpid()}.tmp"
    rc, out = run(GXX + WARN + [opt, "-fPIC", "-x", "c++", base + ".cpp", "-x", "none", "-shared", "-o", tmp, rt,
                                f"-Wl,-rpath,{os.path.dirname(rt)}"])
    if rc:
        return rc, out, None
    os.replace(tmp, so)
    return 0, out, so


def build_many(paths: list[str], include_dirs=None, jobs: int = 2) -> list[tuple[str, int, str, str | None, bool]]:
    """build() for several files at once, `jobs` compilers in parallel -> [(path, rc, output, library, cached)].
    The library entry point of the Metal backend's runtime compile on Linux (csrc/metal/library_emu.cpp):
    it writes the extension's embedded kernel texts, headers already inlined, to files and passes
    include_dirs=[], so nothing is read from the repository's metal/ folder."""
    from concurrent.futures import ThreadPoolExecutor
    runtime_lib()  # once, before the threads

    def one(path):
        tu, _ = generate(path, "exec", include_dirs)
        so = os.path.join(build_dir(), f"{os.path.basename(path)}.exec.{_key(tu, '-O2', runtime_lib())}.so")
        cached = os.path.exists(so)
        rc, out, lib = build(path, include_dirs)
        return path, rc, out, lib, cached
    with ThreadPoolExecutor(max(1, jobs)) as ex:
        return list(ex.map(one, paths))


def check_all(path: str, include_dirs=None) -> list[tuple[str, int, str]]:
    """[(layer, rc, text)] for lint, check, check-as."""
    errs = lint(inline_includes(path, include_dirs)[0], path)
    res = [("lint", len(errs), "\n".join(errs))]
    res.append(("check", *check(path, include_dirs)))
    res.append(("check-as", *check_as(path, include_dirs)))
    return res


def build_embedded(paths: list[str]) -> int:
    """`mslc.py build-embedded F.metal...` (csrc/metal/library_emu.cpp runs it): self-contained kernel texts
    (no include is resolved on disk), $MSL_JOBS compilers in parallel. One line per file on stdout:
    `ok<TAB>file<TAB>library<TAB>cached|compiled` or `fail<TAB>file<TAB>log`, where log holds the compiler's
    diagnostics. Exit status 0 even when a file failed (the caller reports which)."""
    jobs = int(os.environ.get("MSL_JOBS") or 2)
    for path, rc, out, lib, cached in build_many(paths, include_dirs=[], jobs=jobs):
        if rc or not lib:
            log = path + ".log"
            with open(log, "w") as f:
                f.write(out)
            print(f"fail\t{path}\t{log}")
        else:
            print(f"ok\t{path}\t{lib}\t{'cached' if cached else 'compiled'}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__); return 2
    cmd, paths = argv[1], argv[2:]
    if cmd == "build-embedded":
        return build_embedded(paths)
    worst = 0
    for path in paths:
        if cmd == "lint":
            e = lint(inline_includes(path)[0], path); rc, out = len(e), "\n".join(e)
        elif cmd == "check": rc, out = check(path)
        elif cmd == "check3": rc, out = check(path, metal3=True)
        elif cmd == "check-as": rc, out = check_as(path)
        elif cmd == "build": rc, out, so = build(path); out = out or (so or "")
        elif cmd == "all":
            rc, out = 0, ""
            for layer, r, t in check_all(path):
                rc |= r; out += f"{layer}: {'ok' if not r else 'FAIL'}\n" + (t.strip() + "\n" if r else "")
        else:
            print(__doc__); return 2
        print(f"{path}: {cmd}: {'ok' if not rc else 'FAIL'}")
        if out.strip() and (rc or cmd == "all"): print(out.strip())
        worst = worst or (1 if rc else 0)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv))
