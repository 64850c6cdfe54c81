"""The library's shape: modules import only from the layers above them (the order in docs/design.md, "Module
layers"), no import cycle inside a package, and no module over 500 lines."""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dflash_jax")
MAX_LINES = 800  # a module past this is flagged (cut by responsibility, never by trimming docstrings or types)


def modules() -> dict[str, str]:
    """{dotted name under dflash_jax: path} of every library module."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), PKG)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def imports(name: str, path: str) -> set[str]:
    """The dflash_jax modules `name` imports anywhere in its body (lazy imports inside functions count)."""
    is_pkg = path.endswith("__init__.py")
    parts = name.split(".") if name != "__init__" else []
    here = parts if is_pkg else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dflash_jax."):
                    found.add(a.name[len("dflash_jax."):])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("dflash_jax"):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                up = node.level - 1
                base = (here[:len(here) - up] if up else here) + (node.module.split(".") if node.module else [])
            if node.module is None or (node.level == 0 and node.module == "dflash_jax"):
                found.update(".".join(base + [a.name]) for a in node.names)  # from . import x: x may be a module
            else:
                found.add(".".join(base))
    return {f for f in found if f}


def unit(mod: str) -> str:
    return mod.split(".")[0]


def documented_layers() -> dict[str, int]:
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = text.split("## Module layers", 1)[1].split("\n## ", 1)[0]
    layers, current = {}, None
    for line in section.splitlines():
        m = re.match(r"(\d+)\.\s+(.*)", line)
        if m:
            current, text = int(m.group(1)), m.group(2)
        elif current is not None and line.startswith("   "):  # an item continued on the next line
            text = line
        else:
            current = None
            continue
        for name in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", text)):
            layers[name.strip("/").removesuffix(".py")] = current
    return layers


def test_the_documented_layers_cover_every_module():
    layers = documented_layers()
    units = {unit(m) for m in modules()} - {"__init__"}
    assert units - set(layers) == set(), "modules missing from docs/design.md's Module layers"
    assert set(layers) - units == set(), "docs/design.md names modules that do not exist"


def test_modules_import_only_from_layers_above():
    layers = documented_layers()
    mods = modules()
    bad = []
    for name, path in mods.items():
        if name == "__init__":
            continue
        for imp in imports(name, path):
            a, b = unit(name), unit(imp)
            if a != b and b in layers and a in layers and layers[b] >= layers[a]:
                bad.append(f"{name} (layer {layers[a]}) imports {imp} (layer {layers[b]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_inside_a_package():
    mods = modules()
    graph = {n: {i for i in imports(n, p) if i in mods and unit(i) == unit(n) and i != n and i != unit(n)}
             for n, p in mods.items()}
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [n])


def test_no_module_over_the_line_limit():
    long = {n: sum(1 for _ in open(p)) for n, p in modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_the_import_walker_sees_lazy_and_relative_imports(tmp_path):
    """The checks above can fail: a function-level relative import and a package-relative one are found."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from .decode.state import x\n    from ..model import forward\n"
                 "from dflash_jax import planner\nimport dflash_jax.tree\n")
    assert imports("decode.runner", str(p)) == {"decode.decode.state", "model", "planner", "tree"}
    assert imports("engine", str(p)) >= {"decode.state", "planner", "tree"}


def test_no_private_name_crosses_a_module():
    """A `_name` imported from another dflash_jax module is a missing public interface."""
    bad = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dflash_jax")):
                bad += [f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)
