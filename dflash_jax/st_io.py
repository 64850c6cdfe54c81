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
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
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


def text_prefix(names) -> str:
    """The text model's tensor-name prefix in a checkpoint: `model.language_model.` (a multimodal checkpoint, its
    text model beside a vision tower) or `model.`."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def check_names(what: str, want: set, names: set, ignorable=frozenset()) -> None:
    """A one-line ValueError naming the first missing tensors (`want` - `names`) or unexpected ones (`names` - `want`
    - `ignorable`) of `what`."""
    for problem, bad in (("is missing", want - names), ("has unexpected", names - want - set(ignorable))):
        if bad:
            bad = sorted(bad)
            raise ValueError(f"{what} {problem} tensor(s): {bad[:5]}{' ...' if len(bad) > 5 else ''}")


def read_params(st: SafetensorsDir, src: dict, shapes: dict, dtype, ignorable=lambda name: False, place=None) -> dict:
    """A per-layer param tree ({top-level names..., "layers": tuple of per-layer dicts}) from checkpoint tensors.

    src: {our key path ((name,) or ("layers", i, name)): (tensor name, how)}; how = "T" (transpose), None (as is), a
    function of the array (a part of a fused tensor), or - with a tuple of tensor names - a function of their list
    (experts stacked). shapes: our shapes in the same layout. Every tensor the checkpoint has must be used or
    `ignorable(name)`; every shape is checked; errors are one line naming the tensor. place(path, host array, dtype):
    puts one param where it belongs (a mesh: each device its shard), tensor by tensor; default: the default device."""
    import jax.numpy as jnp
    names = set(st.keys())
    used = {m for n, _ in src.values() for m in ((n,) if isinstance(n, str) else n)}
    check_names("checkpoint", used, names, {n for n in names if ignorable(n)})
    dt = jnp.dtype(dtype)
    last: dict = {}  # the latest tensor read: the parts of a fused tensor come one after the other

    def get(path):
        name, how = src[path]
        if isinstance(name, tuple):
            a = how([st.get(n) for n in name])
        else:
            if name not in last:
                last.clear()
                last[name] = np.asarray(st.get(name))
            a = last[name]
            a = a.T if how == "T" else (how(a) if callable(how) else a)
        want = shapes[path[0]] if len(path) == 1 else shapes["layers"][path[1]][path[2]]
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"tensor {name!r} gives {path[-1]} of shape {a.shape}, expected {want} from config.json")
        if place is not None:
            return place(path, np.ascontiguousarray(a), dt)
        return jnp.asarray(np.ascontiguousarray(a), dt)

    params = {k: get((k,)) for k in shapes if k != "layers"}
    params["layers"] = tuple({k: get(("layers", i, k)) for k in lp} for i, lp in enumerate(shapes["layers"]))
    return params
