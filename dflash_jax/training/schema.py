"""Typed loading of YAML into dataclass trees: the generic machinery behind the training configs.

    cfg = build_section(MyConfig, yaml.safe_load(text))
    for k, v in parse_overrides(["a.b=3"]):
        set_override(cfg, k, v)
    check_required(cfg)

Rules:
- every key must name a field; an unknown key is a `ConfigError` naming its full dotted path
  (`train.num_anchor` -> "unknown key 'train.num_anchor' (did you mean 'train.num_anchors'?)");
- values are converted to the field's declared type (int, float, str, bool, Optional, list[...],
  dict, nested section); a value that does not convert is an error naming the key;
- overrides `a.b=value` use the same conversion (the text is read as YAML first, so `[1, 2]`,
  `null` and `true` work; `3e-4` is a float for a float field);
- a field left at `MISSING` (a required key) is an error in `check_required`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A problem with a training config (file, key, value or override)."""


MISSING = "???"  # the YAML-visible marker of a required value


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _convert(value: Any, tp, where: str):
    """Convert `value` (from YAML or an override) to type `tp`; errors name `where`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            if len(non_none) != len(args):
                return None
            raise ConfigError(f"{where}: null is not allowed (expected {_type_name(tp)})")
        errors = []
        for a in non_none:
            try:
                return _convert(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: cannot convert {value!r} to {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:
            raise ConfigError(f"{where}: expected a mapping for section '{where}', got null")
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for section '{where}', got {type(value).__name__}")
        return build_section(tp, value, where)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    f = math.nan
                if f.is_integer():
                    return int(f)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def _unknown(key: str, where: str, valid) -> ConfigError:
    full = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" (did you mean '{(where + '.') if where else ''}{close[0]}'?)" if close else ""
    return ConfigError(f"unknown key '{full}'{hint}; valid keys{' of ' + where if where else ''}: {sorted(valid)}")


def build_section(cls, data: dict, where: str = ""):
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(str(key), where, fields)
        sub = f"{where}.{key}" if where else key
        kwargs[key] = _convert(value, hints[key], sub)
    return cls(**kwargs)


def _paths_of(cls, name: str, where: str = "") -> list[str]:
    """Dotted paths of every field called `name` in the config tree of dataclass `cls`."""
    out = []
    for f in dataclasses.fields(cls):
        path = f"{where}.{f.name}" if where else f.name
        if f.name == name:
            out.append(path)
        tp = _strip_optional(_hints(cls)[f.name])
        if dataclasses.is_dataclass(tp):
            out.extend(_paths_of(tp, name, path))
    return out


def set_override(cfg, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    obj, where = cfg, ""
    for i, name in enumerate(parts):
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"override '{dotted}': '{where}' is not a section")
        fields = {f.name for f in dataclasses.fields(obj)}
        if name not in fields:
            elsewhere = _paths_of(type(cfg), name)
            if elsewhere:  # the right key in another section, e.g. train.lr -> optimizer.lr
                raise ConfigError(f"override '{dotted}={raw}': unknown key '{dotted}' (did you mean "
                                  f"{' or '.join(repr(p) for p in elsewhere)}?)")
            raise ConfigError(f"override '{dotted}={raw}': {_unknown(name, where, fields)}")
        where = f"{where}.{name}" if where else name
        if i == len(parts) - 1:
            tp = _hints(type(obj))[name]
            try:
                value = yaml.safe_load(raw) if raw.strip() else raw
            except yaml.YAMLError:
                value = raw
            if isinstance(value, (int, float)) and not isinstance(value, bool) and _accepts(tp, str) \
                    and not _accepts(tp, float):
                value = raw  # a str field keeps the text as typed (e.g. "007")
            if dataclasses.is_dataclass(_strip_optional(tp)) and value is not None and not isinstance(value, dict):
                raise ConfigError(f"override '{dotted}': '{where}' is a section; set its keys ('{where}.KEY=...')")
            setattr(obj, name, _convert(value, tp, where))
        else:
            nxt = getattr(obj, name)
            if nxt is None:
                tp = _strip_optional(_hints(type(obj))[name])
                if not dataclasses.is_dataclass(tp):
                    raise ConfigError(f"override '{dotted}': '{where}' is not a section")
                nxt = tp()
                setattr(obj, name, nxt)
            obj = nxt


def _strip_optional(tp):
    if typing.get_origin(tp) in (Union, types.UnionType):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return tp


def _accepts(tp, base) -> bool:
    tp = _strip_optional(tp)
    return tp is base


def parse_overrides(items) -> list[tuple[str, str]]:
    out = []
    for it in items or ():
        if "=" not in it:
            raise ConfigError(f"override {it!r} is not of the form section.key=value")
        k, v = it.split("=", 1)
        k = k.strip()
        if not k:
            raise ConfigError(f"override {it!r} has an empty key")
        out.append((k, v))
    return out


def check_required(obj, where=""):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        sub = f"{where}.{f.name}" if where else f.name
        if isinstance(v, str) and v == MISSING:
            raise ConfigError(f"missing required key '{sub}'")
        if dataclasses.is_dataclass(v):
            check_required(v, sub)


def fingerprint(d: dict) -> str:
    """A short stable hash of a JSON-able dict (settings that determine some output)."""
    import hashlib
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
