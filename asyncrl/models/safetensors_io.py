"""Minimal safetensors reader/writer over NumPy memory maps.

We read the format ourselves (8-byte header length, JSON header, raw little-endian bytes) because it lets us
memory-map each tensor and hand out only the slice a device needs, in bf16 too (via ml_dtypes), without
going through torch or an extra copy. Files written here are read by the `safetensors` package and by
transformers (tested).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    """Lazily memory-mapped tensors of one .safetensors file."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise SafetensorsError(f"{path}: truncated file (no header)")
                (n,) = struct.unpack("<Q", raw)
                header = json.loads(f.read(n))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: not a readable safetensors file ({e})") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self._header: dict[str, dict[str, Any]] = header
        self._offset = 8 + n
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only view into the mapped file (no copy until the caller converts it)."""
        info = self._header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        buf = self._mmap[self._offset + start : self._offset + end]
        return buf.view(dtype).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (C-contiguous copies are made as needed), atomically via a temp file + rename."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the spec asks for 8-byte alignment of the data section
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)
