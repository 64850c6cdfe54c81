"""A small file-system layer for data shards: local paths, or URLs through fsspec (gs://, file://, memory://).

Local writes are atomic (temp file + fsync + rename). Object stores (gs://) make each object
visible whole or not at all, so a URL write is one `open(..., "wb")`; on `file://` URLs fsspec
writes in place, which is fine because a shard is committed by its .json index written last.
gs:// needs the `gcsfs` package (pip install gcsfs).
"""
from __future__ import annotations

import glob as _glob
import io
import json
import os

import numpy as np


def is_url(path: str) -> bool:
    return "://" in path


def _fs(path: str):
    try:
        import fsspec
    except ImportError:
        raise ValueError(f"{path}: URLs need the `fsspec` package (pip install fsspec; gcsfs for gs://)") from None
    try:
        fs, _ = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{path}: no file system for this URL ({e}); gs:// needs `pip install gcsfs`") from None
    return fs


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name if is_url(base) else os.path.join(base, name)


def exists(path: str) -> bool:
    return _fs(path).exists(path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _fs(path).isdir(path) if is_url(path) else os.path.isdir(path)


def makedirs(path: str) -> None:
    if is_url(path):
        _fs(path).makedirs(path, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def glob(pattern: str) -> list[str]:
    """Matching paths, sorted, spelled like `pattern` (URLs keep their protocol)."""
    if not is_url(pattern):
        return sorted(_glob.glob(pattern))
    fs = _fs(pattern)
    proto = pattern.split("://", 1)[0]
    out = []
    for p in fs.glob(pattern):
        out.append(p if "://" in p else f"{proto}://{p}" if proto != "file" else f"file://{p}")
    return sorted(out)


def read_bytes(path: str) -> bytes:
    if is_url(path):
        with _fs(path).open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def read_json(path: str):
    return json.loads(read_bytes(path))


def write_bytes(path: str, data: bytes) -> None:
    """All or nothing: a reader sees the old file (or none) or the whole new one."""
    if is_url(path):
        with _fs(path).open(path, "wb") as f:
            f.write(data)
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str, obj) -> None:
    write_bytes(path, json.dumps(obj).encode())


def write_npy(path: str, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr)
    write_bytes(path, buf.getvalue())


def read_npy(path: str) -> np.ndarray:
    if is_url(path):
        return np.load(io.BytesIO(read_bytes(path)))
    return np.load(path, mmap_mode="r")
