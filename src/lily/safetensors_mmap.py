"""Zero-copy `.safetensors` reader (and a small writer) with NumPy memory maps.

Why our own: the `safetensors` package cannot hand NumPy a bf16 tensor, copies every tensor into
memory, and its errors do not say which file/tensor is broken. Here the header (8-byte little-endian
length + JSON) is parsed and validated up front, and each tensor is a read-only view into one
`np.memmap` of the file: no bytes are read until the engine touches them.

bf16 (and the fp8 variants) are returned as their raw bit patterns (np.uint16 / np.uint8); the
dtype tag is kept in `SafetensorsFile.dtype(name)`.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from .errors import CheckpointError

# safetensors dtype tag -> numpy dtype holding the same bytes
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(np.uint8), "F8_E5M2": np.dtype(np.uint8),
}
# the inverse, for writing (bf16 arrays must be passed with an explicit "BF16" tag: they are uint16)
_TAG_OF = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
           np.dtype("<u2"): "U16", np.dtype("<i2"): "I16", np.dtype("<f2"): "F16",
           np.dtype("<u4"): "U32", np.dtype("<i4"): "I32", np.dtype("<f4"): "F32",
           np.dtype("<u8"): "U64", np.dtype("<i8"): "I64", np.dtype("<f8"): "F64"}

# a header larger than this is not a real checkpoint (the 35B model's header is ~200 KB)
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str            # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    start: int            # byte offsets into the data section (after the header)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile(Mapping[str, np.ndarray]):
    """A `.safetensors` file as a read-only mapping name -> np.ndarray view of a memmap.

    Raises CheckpointError (naming the file and tensor) for a truncated file, a malformed header,
    an unknown dtype, or offsets that overlap / do not match the shape.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            file_size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"[lily.load] {self.path}: truncated safetensors file "
                                          f"({file_size} bytes; the 8-byte header length is missing)")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > MAX_HEADER_BYTES or 8 + hlen > file_size:
                    raise CheckpointError(
                        f"[lily.load] {self.path}: truncated or not a safetensors file (header length "
                        f"{hlen} bytes, file size {file_size} bytes)")
                raw = f.read(hlen)
        except OSError as e:
            raise CheckpointError(f"[lily.load] cannot read {self.path}: {e}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"[lily.load] {self.path}: safetensors header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"[lily.load] {self.path}: safetensors header must be a JSON object")
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = meta if isinstance(meta, dict) else {}
        self.data_offset = 8 + hlen
        data_size = file_size - self.data_offset
        self.infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.infos[name] = _parse_entry(self.path, name, entry, data_size)
        _check_overlap(self.path, self.infos)
        self._mm: np.memmap | None = None
        self._data_size = data_size

    # ---- Mapping ---------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        info = self.infos.get(name)
        if info is None:
            raise KeyError(name)
        dt = DTYPES[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, dt)
        if self._mm is None:
            # one map of the data section per file; every tensor is a view of it (keeps it alive)
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset,
                                 shape=(self._data_size,))
        return self._mm[info.start:info.end].view(dt).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag ("BF16", "F32", "U32", ...)."""
        return self.infos[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.infos[name].shape


def _parse_entry(path: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"[lily.load] {path}: tensor {name}: {msg}")
    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    tag = entry.get("dtype")
    if tag not in DTYPES:
        raise bad(f"unknown dtype {tag!r} (supported: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    offs = entry.get("data_offsets")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise bad(f"bad shape {shape!r}")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise bad(f"bad data_offsets {offs!r}")
    start, end = offs
    want = int(np.prod(shape, dtype=np.int64)) * DTYPES[tag].itemsize
    if end - start != want:
        raise bad(f"data_offsets {offs} hold {end - start} bytes but shape {tuple(shape)} {tag} needs {want}")
    if end > data_size:
        raise bad(f"file is truncated: the tensor ends at data byte {end} but the file has only "
                  f"{data_size} data bytes (re-download the shard)")
    return TensorInfo(name, tag, tuple(shape), start, end)


def _check_overlap(path: Path, infos: dict[str, TensorInfo]) -> None:
    spans = sorted((i.start, i.end, i.name) for i in infos.values() if i.nbytes)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CheckpointError(f"[lily.load] {path}: tensors {n0} and {n1} overlap in the file")


# ---- writer ----------------------------------------------------------------------------------------
def save_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
              dtypes: Mapping[str, str] | None = None, metadata: Mapping[str, str] | None = None) -> int:
    """Write a `.safetensors` file; returns its size in bytes.

    `dtypes` gives the tag for tensors whose NumPy dtype is ambiguous: bf16 bit patterns (uint16)
    need "BF16". Streams each tensor to disk (no full copy of the file in memory). The header is
    padded with spaces to a multiple of 8 bytes so every tensor is 8-byte aligned when its
    predecessors' sizes are (same as the reference implementation).
    """
    dtypes = dict(dtypes or {})
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays = []
    off = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        native = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        tag = dtypes.get(name) or _TAG_OF.get(native)
        if tag is None or tag not in DTYPES:
            raise ValueError(f"save_file: tensor {name}: cannot store dtype {arr.dtype} (tag {tag!r})")
        if DTYPES[tag].itemsize != arr.dtype.itemsize:
            raise ValueError(f"save_file: tensor {name}: tag {tag} does not fit dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        entries[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        arrays.append(arr)
        off += arr.nbytes
    hdr = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    hdr += b" " * (-len(hdr) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for arr in arrays:
            if arr.nbytes:
                f.write(memoryview(arr.reshape(-1).view(np.uint8)))
    return 8 + len(hdr) + off
