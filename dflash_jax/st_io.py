"""Minimal safetensors reader/writer on numpy memory maps (no torch, bf16 via ml_dtypes).

Reading is lazy: `SafetensorsDir.get(name)` returns a read-only memmap view, so a sharded loader
can slice exactly the part one device needs without materialising the whole tensor.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsDir:
    """All tensors of a model directory: `model.safetensors` or a sharded index."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(single):
            files = ["model.safetensors"]
        else:
            files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors")) if os.path.isdir(path) else []
            if not files:
                raise FileNotFoundError(f"no model.safetensors (or index) in {path}")
        self._entries: dict[str, tuple[str, dict, int]] = {}
        for fn in files:
            full = os.path.join(path, fn)
            header, offset = _read_header(full)
            for name, meta in header.items():
                self._entries[name] = (full, meta, offset)
        self._maps: dict[str, np.memmap] = {}

    def keys(self):
        return self._entries.keys()

    def __contains__(self, name):
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        full, meta, offset = self._entries[name]
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {meta['dtype']}")
        if full not in self._maps:
            self._maps[full] = np.memmap(full, dtype=np.uint8, mode="r")
        start, end = meta["data_offsets"]
        buf = self._maps[full][offset + start: offset + end]
        return buf.view(_DTYPES[meta["dtype"]]).reshape(meta["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """Write a safetensors file (atomically: a temp file renamed into place)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {a.dtype}")
        nbytes = a.nbytes
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)
