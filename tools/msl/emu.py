"""Python harness of the Metal emulator: build a .metal file, bind numpy buffers and params.h structs, dispatch.

    lib = emu.library("metal/gemv.metal")
    p = emu.params("GemvParams", rows=N, cols=K)
    out = emu.run3(lib, "gemv_q4", grid=(n_tg, 1, 1), tg=(64, 1, 1), buffers=[w, s, b, x, y, p], outputs=[4])

Every dispatch (isolate=True) runs in a forked child. There each buffer sits between two PROT_NONE guard
pages, ends 16-byte aligned right before the back one, and its slack is filled with 0xFF (NaN); buffers
bound to `device const` / `constant` parameters are made read-only. Out-of-bounds access, writes to inputs
and crashes become reported failures instead of silent corruption.
"""
from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import pickle
import re
import signal
import sys
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mslc  # noqa: E402

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE, PROT_READ, PROT_RW = 0, 1, 3
CHILD_TIMEOUT_S = 300

_CTYPES = {"int8_t": "i1", "uint8_t": "u1", "int16_t": "i2", "uint16_t": "u2", "int32_t": "i4", "uint32_t": "u4",
           "int64_t": "i8", "uint64_t": "u8", "float": "f4", "int": "i4", "uint": "u4"}


def struct_dtype(name: str) -> np.dtype:
    """numpy dtype of a params.h struct with C layout (checked against the compiler at library load)."""
    fields = mslc.parse_structs().get(name)
    if fields is None:
        raise KeyError(f"params.h has no struct {name!r}")
    spec = [(f, _CTYPES[t], (n,)) if n else (f, _CTYPES[t]) for t, f, n in fields]
    return np.dtype(spec, align=True)


def params(name: str, **values) -> np.ndarray:
    """A params.h struct as a 0-d structured array; fields not given are 0."""
    dt = struct_dtype(name)
    a = np.zeros((), dt)
    for k, v in values.items():
        if k not in dt.names:
            raise KeyError(f"{name} has no field {k!r} (fields: {dt.names})")
        a[k] = v
    return a


def _guarded(a: np.ndarray, readonly: bool):
    """Copy of a between guard pages, ending 16-byte aligned at the back guard; returns (view, keepalive)."""
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    n = (raw.nbytes + 15) // 16 * 16 or 16
    body = (n + PAGE - 1) // PAGE * PAGE
    total = body + 2 * PAGE
    base = _libc.mmap(None, total, PROT_RW, 0x22, -1, 0)  # MAP_PRIVATE | MAP_ANONYMOUS
    if base in (None, ctypes.c_void_p(-1).value):
        raise MemoryError("mmap failed")
    buf = (ctypes.c_uint8 * total).from_address(base)
    mem = np.frombuffer(buf, np.uint8)
    start = PAGE + body - n
    mem[PAGE:start] = 0xFF
    mem[start:start + raw.nbytes] = raw
    mem[start + raw.nbytes:PAGE + body] = 0xFF
    _libc.mprotect(base, PAGE, PROT_NONE)
    _libc.mprotect(base + PAGE + body, PAGE, PROT_NONE)
    if readonly:
        _libc.mprotect(base + PAGE, body, PROT_READ)
    view = mem[start:start + raw.nbytes]
    return view, base + start


@dataclass
class Result:
    ndiag: int
    msg: str
    stats: dict
    out: list = field(default_factory=list)  # arrays by buffer index (None where unbound)

    @property
    def ok(self) -> bool:
        return self.ndiag == 0


class Library:
    """One .metal file built for the emulator; kernels are looked up by [[host_name]] (or plain name)."""

    def __init__(self, path: str, include_dirs=None):
        self.path = os.path.abspath(path)
        rc, out, so = mslc.build(self.path, include_dirs)
        if rc:
            raise RuntimeError(f"build of {path} failed:\n{out}")
        ctypes.CDLL(mslc.runtime_lib(), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(so)
        self.lib.msl_dispatch.restype = ctypes.c_int
        text, _ = mslc.inline_includes(self.path, include_dirs)
        self.info = mslc.parse(text)
        self.entries = mslc.entry_points(self.info)
        self.fcs = {f["index"]: f for f in self.info["fcs"]}
        self._check_layouts(text)

    def _check_layouts(self, text: str) -> None:
        for name, fields in mslc.parse_structs().items():
            if not re.search(r"\b" + name + r"\b", text):
                continue
            arr = (ctypes.c_ulong * (1 + len(fields))).in_dll(self.lib, f"__msl_layout_{name}")
            dt = struct_dtype(name)
            want = [dt.itemsize] + [dt.fields[f][1] for _, f, _ in fields]
            if list(arr) != want:
                raise RuntimeError(f"params.h struct {name}: compiler layout {list(arr)} != numpy layout {want}")

    @property
    def kernels(self) -> list[str]:
        return sorted(self.entries)

    def buffer_params(self, kernel: str) -> dict[int, tuple[str, bool]]:
        """[[buffer(i)]] -> (declaration, read_only) for a kernel."""
        k, _ = self.entries[kernel]
        out = {}
        for decl, attr in k["params"]:
            m = re.match(r"buffer\(\s*(\d+)\s*\)", attr or "")
            if m:
                head = re.split(r"[*&]", decl)[0].split()
                out[int(m.group(1))] = (decl, "const" in head or "constant" in head)
        return out

    def dispatch(self, kernel: str, grid, tg, buffers, tg_mem=(), fc=None, sched: int = 0, seed: int = 0,
                 nthreads: int = 2, isolate: bool = True) -> Result:
        """grid = threadgroups per grid (x, y, z); tg = threads per threadgroup (x, y, z).
        buffers: list or dict {index: array}; tg_mem: byte sizes of [[threadgroup(i)]] buffers;
        fc: {function_constant index: value}; reading one that is not given is reported."""
        if kernel not in self.entries:
            raise KeyError(f"{os.path.basename(self.path)} has no kernel {kernel!r}; have {self.kernels}")
        k, _ = self.entries[kernel]
        bufs = dict(enumerate(buffers)) if isinstance(buffers, (list, tuple)) else dict(buffers)
        bufs = {i: b for i, b in bufs.items() if b is not None}
        bp = self.buffer_params(kernel)
        missing = sorted(set(bp) - set(bufs))
        if missing:
            raise ValueError(f"{kernel}: buffer(s) {missing} not bound ({[bp[i][0] for i in missing]})")
        grid = tuple((list(grid) + [1, 1, 1])[:3])
        tg = tuple((list(tg) + [1, 1, 1])[:3])
        if int(np.prod(tg)) > k["max_threads"]:
            raise ValueError(f"{kernel}: {int(np.prod(tg))} threads per threadgroup > max_total_threads_per_threadgroup "
                             f"{k['max_threads']}")
        fc = dict(fc or {})
        if set(fc) - set(self.fcs):
            raise ValueError(f"{kernel}: function constants {sorted(set(fc) - set(self.fcs))} are not declared")
        args = (kernel, grid, tg, bufs, bp, tuple(tg_mem), fc, sched, seed, nthreads)
        if not isolate:
            return self._dispatch(*args, guard=False)
        return self._isolated(args)

    def _isolated(self, args) -> Result:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            faulthandler.disable()  # a planted fault should end the child quietly; the parent reports it
            signal.alarm(CHILD_TIMEOUT_S)
            try:
                res = self._dispatch(*args, guard=True)
                data = pickle.dumps(res)
            except BaseException as ex:  # noqa: BLE001 - any failure is reported to the parent
                data = pickle.dumps(Result(1, f"ERROR: {ex!r}", {}, []))
            with os.fdopen(w, "wb") as f:
                f.write(data)
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) or not data:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            why = {signal.SIGSEGV: " (out-of-bounds buffer access or write to a read-only buffer?)",
                   signal.SIGALRM: f" (timed out after {CHILD_TIMEOUT_S} s)"}.get(sig, "")
            return Result(1, f"ERROR: kernel crashed with signal {sig}{why}", {}, [])
        return pickle.loads(data)

    def _dispatch(self, kernel, grid, tg, bufs, bp, tg_mem, fc, sched, seed, nthreads, guard) -> Result:
        fc_tab = (ctypes.c_ulonglong * 64).in_dll(self.lib, "__msl_fc")
        fc_def = (ctypes.c_ubyte * 64).in_dll(self.lib, "__msl_fc_defined")
        for i in range(64):
            fc_tab[i] = 0
            fc_def[i] = 0
        for i, v in fc.items():
            ty = self.fcs[i]["type"]
            b = np.array(v, {"bool": np.bool_, "float": np.float32, "short": np.int16, "ushort": np.uint16}
                         .get(ty, np.int32 if ty in ("int", "int32_t") else np.uint32)).tobytes()
            fc_tab[i] = int.from_bytes(b.ljust(8, b"\0"), "little")
            fc_def[i] = 1
        n = max(bufs) + 1 if bufs else 1
        ptrs = (ctypes.c_void_p * n)()
        views = {}
        for i, a in bufs.items():
            a = np.asarray(a)
            ro = bp.get(i, ("", False))[1]
            if guard:
                v, addr = _guarded(a, ro)
            else:
                v = np.ascontiguousarray(a).reshape(-1).view(np.uint8).copy()
                addr = v.ctypes.data
            views[i] = (v, a)
            ptrs[i] = addr
        fn = getattr(self.lib, f"__msl_launch_{kernel}")
        u3 = lambda t: (ctypes.c_uint * 3)(*t)  # noqa: E731
        sizes = (ctypes.c_ulong * max(1, len(tg_mem)))(*tg_mem)
        msg = ctypes.create_string_buffer(1 << 16)
        stats = (ctypes.c_double * 8)()
        nd = self.lib.msl_dispatch(ctypes.cast(fn, ctypes.c_void_p), u3(grid), u3(tg), ptrs, sizes, len(tg_mem),
                                   sched, seed, nthreads, msg, len(msg), stats)
        st = dict(secs=stats[0], threads=stats[1], switches=stats[2], collectives=stats[3], barriers=stats[4],
                  divergent=stats[5])
        out = [None] * n
        for i, (v, a) in views.items():
            out[i] = np.array(v).view(a.dtype).reshape(a.shape) if a.ndim else np.array(v).view(a.dtype)[0]
        return Result(nd, msg.value.decode(), st, out)


_LIBS: dict[str, Library] = {}


def library(path: str, include_dirs=None) -> Library:
    """Cached Library per path (relative paths are taken from the repository root)."""
    full = path if os.path.isabs(path) else os.path.join(mslc.REPO, path)
    key = os.path.abspath(full) + repr(include_dirs)
    if key not in _LIBS:
        _LIBS[key] = Library(full, include_dirs)
    return _LIBS[key]


class EmulatorError(AssertionError):
    pass


def run3(lib: Library, kernel: str, grid, tg, buffers, outputs, tg_mem=(), fc=None, nthreads: int = 2,
         seed: int = 1, poison: bool = True) -> list[np.ndarray]:
    """Dispatch in the three schedules (forward, reverse, shuffled); raise EmulatorError on any diagnostic
    or any difference between schedules (a race); return the output buffers (list, in `outputs` order).
    poison: output buffers (True: all of `outputs`; or a list of buffer indices, e.g. to spare in/out
    buffers) are filled with NaN (0xFF bytes) first, so unwritten elements show."""
    bufs = dict(enumerate(buffers)) if isinstance(buffers, (list, tuple)) else dict(buffers)
    bufs = {i: (np.asarray(b).copy() if b is not None else None) for i, b in bufs.items()}
    for i in (outputs if poison is True else (poison or [])):
        bufs[i].reshape(-1).view(np.uint8)[:] = 0xFF
    results = []
    for sched in (0, 1, 2):
        r = lib.dispatch(kernel, grid, tg, bufs, tg_mem=tg_mem, fc=fc, sched=sched, seed=seed, nthreads=nthreads)
        if not r.ok:
            raise EmulatorError(f"{kernel} (schedule {sched}): {r.msg.strip()}")
        results.append([r.out[i] for i in outputs])
    for sched in (1, 2):
        for i, a, b in zip(outputs, results[0], results[sched]):
            if a.tobytes() != b.tobytes():
                raise EmulatorError(f"{kernel}: buffer {i} differs between schedule 0 and {sched} (a race?)")
    return results[0]
