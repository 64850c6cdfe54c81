"""The shape of a decode cycle - what one cycle drafts and verifies - as a typed value, and its one parser.

    TargetOnly()      one target step a cycle, no drafter
    Chain(b)          the drafter's block of b tokens (anchor + b - 1 drafts) verified as a chain;
                      Chain() is the drafter's full block
    Tree(n)           a draft tree of n nodes (depth <= block - 1) verified in one pass; Tree(n, b): depth b - 1
    Auto()            chosen per call (dflash_jax.auto, decode.auto_glue)

`parse_shape(block_size=..., tree_budget=..., shape=...)` reads what the API and the CLIs accept (ints,
strings such as "auto", "chain:8", "tree:16", "off", None) into one of these; `Shape.resolve(drafter_block)`
fills the drafter's defaults and checks the shape against it. Every bad value is a one-line ValueError.
Pure Python: no jax, no models.
"""
from __future__ import annotations

import dataclasses
import numbers

MAX_TREE_NODES = 1023  # the most nodes a draft tree may have: root + nodes = 1024 verified rows per batch row
# (the tree's attention mask is [rows, rows] per batch row; a larger tree costs more than any depth it can reach pays)

_OFF = ("off", "none", "target", "target-only", "target_only")


class Shape:
    """Base of TargetOnly, Chain, Tree and Auto (frozen dataclasses)."""

    @staticmethod
    def parse(value) -> "Shape":
        """A Shape from a Shape, "auto", "off", "chain", "chain:B", "tree:N", "tree:N:B", an int B (a chain of B)
        or None (the chain of the drafter's full block)."""
        return _parse_one(value, "shape")

    @property
    def block(self) -> int | None:
        """The verified block (1: target-only; None: the drafter's, not yet resolved)."""
        return 1

    @property
    def tree(self) -> int | None:
        """The tree's node budget (None: not a tree)."""
        return None

    def resolve(self, drafter_block: int | None, vocab_size: int | None = None) -> "Shape":
        """This shape checked against a drafter whose block is `drafter_block` (None: no drafter) with the
        drafter's defaults filled in. Without a drafter every shape but a tree is target-only."""
        return self

    @property
    def label(self) -> str:
        """How reports name it: "target-only", "B=8", "tree 16", "auto"."""
        return str(self)


@dataclasses.dataclass(frozen=True)
class TargetOnly(Shape):
    def __str__(self):
        return "off"

    @property
    def label(self) -> str:
        return "target-only"


@dataclasses.dataclass(frozen=True)
class Auto(Shape):
    def __str__(self):
        return "auto"

    @property
    def block(self) -> int | None:
        return None

    def resolve(self, drafter_block, vocab_size=None) -> Shape:
        return self if drafter_block is not None else TargetOnly()


@dataclasses.dataclass(frozen=True)
class Chain(Shape):
    size: int | None = None  # the block (anchor + drafts); None: the drafter's full block

    def __post_init__(self):
        if self.size is not None:
            object.__setattr__(self, "size", _integer(self.size, "block_size", 2))

    def __str__(self):
        return "chain" if self.size is None else f"chain:{self.size}"

    @property
    def block(self) -> int | None:
        return self.size

    def resolve(self, drafter_block, vocab_size=None) -> Shape:
        if drafter_block is None:
            return TargetOnly()
        return Chain(_check_block(self.size, drafter_block))

    @property
    def label(self) -> str:
        return f"B={self.size}" if self.size is not None else "chain"


@dataclasses.dataclass(frozen=True)
class Tree(Shape):
    nodes: int  # draft nodes verified per cycle (besides the root, the anchor)
    size: int | None = None  # the drafter block whose distributions build it (depth size - 1); None: the drafter's

    def __post_init__(self):
        n = _integer(self.nodes, "tree_budget", 1, " (or None for the chain)")
        if n > MAX_TREE_NODES:
            raise ValueError(f"tree_budget {n} is above the most nodes a draft tree may have "
                             f"(MAX_TREE_NODES = {MAX_TREE_NODES})")
        object.__setattr__(self, "nodes", n)
        if self.size is not None:
            object.__setattr__(self, "size", _integer(self.size, "block_size", 2))

    def __str__(self):
        return f"tree:{self.nodes}" + (f":{self.size}" if self.size is not None else "")

    @property
    def block(self) -> int | None:
        return self.size

    @property
    def tree(self) -> int | None:
        return self.nodes

    def resolve(self, drafter_block, vocab_size=None) -> Shape:
        if drafter_block is None:
            raise ValueError("tree_budget needs a drafter")
        b = _check_block(self.size, drafter_block)
        if vocab_size is not None:  # a depth-D tree over V tokens has at most V + V^2 + ... + V^D nodes
            room, level = 0, 1
            for _ in range(b - 1):
                level *= int(vocab_size)
                room += level
                if room >= self.nodes:
                    break
            if room < self.nodes:
                raise ValueError(f"tree_budget {self.nodes} is more nodes than a depth-{b - 1} tree over "
                                 f"{vocab_size} tokens holds ({room})")
        return Tree(self.nodes, b)

    @property
    def label(self) -> str:
        return f"tree {self.nodes}"


def _integer(v, name: str, least: int, extra: str = "") -> int:
    """v as an int >= least (ints, numpy ints, integral floats, digit strings), else a one-line ValueError."""
    if isinstance(v, bool):
        ok = False
    elif isinstance(v, str):
        ok = v.strip().isdigit()
        v = int(v) if ok else v
    else:
        try:
            ok = int(v) == v
        except (TypeError, ValueError, OverflowError):
            ok = False
    if not ok or int(v) < least:
        raise ValueError(f"{name} must be an integer >= {least}{extra}, got {v!r}")
    return int(v)


def _check_block(size: int | None, drafter_block: int) -> int:
    b = drafter_block if size is None else size
    if not 2 <= b <= drafter_block:
        raise ValueError(f"block_size must be in [2, {drafter_block}] for this drafter, got {b}")
    return b


def _parse_one(value, name: str) -> Shape:
    if isinstance(value, Shape):
        return value
    if value is None:
        return Chain()
    if isinstance(value, str):
        s = value.strip().lower()
        if s == "auto":
            return Auto()
        if s in _OFF:
            return TargetOnly()
        head, _, rest = s.partition(":")
        if head == "chain":
            return Chain(rest or None)
        if head == "tree" and rest:
            n, _, b = rest.partition(":")
            return Tree(n, b or None)
        if s.isdigit():
            return Chain(s)
        raise ValueError(f"{name} must be 'auto', 'off', 'chain', 'chain:B', 'tree:N', 'tree:N:B' or an integer "
                         f"block >= 2, got {value!r}")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return Chain(int(value))
    raise ValueError(f"{name} must be a Shape, a string such as 'auto' / 'chain:8' / 'tree:16' / 'off', an integer "
                     f"block or None, got {value!r}")


def parse_shape(block_size="auto", tree_budget=None, shape=None) -> Shape:
    """The shape of generate()'s arguments: `shape` (a Shape or a string / int for Shape.parse) or the older pair
    block_size ("auto", None: the drafter's full block, an int B) and tree_budget (None: a chain, an int N: a tree
    of N nodes, "auto"). "auto" in either is Auto(); block "auto" with a tree of N nodes is Tree(N)."""
    if shape is not None:
        if block_size not in ("auto", None) or tree_budget is not None:
            raise ValueError(f"give shape= or block_size / tree_budget, not both (shape={shape!r}, "
                             f"block_size={block_size!r}, tree_budget={tree_budget!r})")
        return _parse_one(shape, "shape")
    if isinstance(block_size, Shape):
        raise ValueError(f"a Shape goes in shape=, not block_size= (got block_size={block_size!r})")
    if isinstance(block_size, str) and block_size.strip().lower() == "auto":
        block_size = "auto"
    elif block_size is not None:
        block_size = _integer(block_size, "block_size", 2, ", None or 'auto'")
    if isinstance(tree_budget, str) and tree_budget.strip().lower() == "auto":
        if block_size not in ("auto", None):
            raise ValueError(f"tree_budget='auto' chooses the block too: leave block_size None or 'auto', "
                             f"got block_size={block_size!r}")
        return Auto()
    if tree_budget is None:
        return Auto() if block_size == "auto" else Chain(block_size)
    return Tree(tree_budget, None if block_size == "auto" else block_size)
