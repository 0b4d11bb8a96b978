"""The text of a compiled XLA program (`compiled.as_text()`) read into computations of instructions, and the arrays
of an HLO type with their sizes: what `hlo_cost.py` counts over, and the largest buffers a program makes (what an
out-of-memory report names).

A type's size is its bytes as laid out: the layout's first tile pads the two most minor physical dims (`T(8,128)`
rounds them up to 8 and 128), as XLA's own sizes do, and `S(n)` names the memory space (0 is HBM; on TPU 1 is
VMEM, 5 pinned host). A line the reader cannot parse is skipped, not fatal: a cost estimate that misses one
instruction is still useful where one that fails is not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([0-9,\s]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
# Outputs that alias another buffer, so that largest_buffers names each buffer once.
_ALIASING_OPS = frozenset("get-tuple-element tuple bitcast while conditional call opt-barrier constant".split())
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


class Leaf(NamedTuple):
    """One array of a (possibly tuple) HLO type."""

    dtype: str
    dims: tuple[int, ...]
    memory_space: int
    bytes: float  # with tile padding



def dtype_bytes(dtype: str) -> float:
    """Bytes of one element: bf16 2, s4 0.5, f8e4m3fn 1, pred 1, token 0."""
    m = re.match(r"[a-z]+?(\d+)", dtype)
    return 1.0 if dtype == "pred" else int(m.group(1)) / 8 if m else 0.0


def parse_shape(type_str: str) -> list[Leaf]:
    """The arrays of an HLO type such as `(s32[], bf16[8,128]{1,0:T(8,128)(2,1)S(1)})`, in order."""
    leaves = []
    for dtype, dims_str, layout in _LEAF.findall(type_str):
        dims = tuple(int(d) for d in dims_str.replace(" ", "").split(",") if d)
        space = re.search(r"S\((\d+)\)", layout)
        leaves.append(Leaf(dtype, dims, int(space.group(1)) if space else 0,
                           _padded_elements(dims, layout) * dtype_bytes(dtype)))
    return leaves


def _padded_elements(dims: tuple[int, ...], layout: str) -> int:
    tile = re.search(r"T\(([\d,]*)\)", layout)
    minor_to_major = [int(d) for d in layout.split(":")[0].split(",") if d.strip().isdigit()]
    if not tile or len(minor_to_major) != len(dims):  # no tiling, or tile dims we do not model (`*`, `?`)
        return math.prod(dims)
    tile_dims = [int(t) for t in tile.group(1).split(",") if t]
    physical = [dims[d] for d in reversed(minor_to_major)]
    physical = [1] * max(0, len(tile_dims) - len(physical)) + physical
    for i, t in enumerate(reversed(tile_dims)):
        physical[-1 - i] = -(-physical[-1 - i] // t) * t
    return math.prod(physical)


@dataclass
class Instr:
    name: str
    type_str: str
    op: str
    operands: list[str]
    operand_text: str
    attrs: str

    @property
    def leaves(self) -> list[Leaf]:
        return parse_shape(self.type_str)

    def called(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    def callees(self) -> list[str]:
        """Computations this instruction runs as code of the executed program (not per-element appliers)."""
        if self.op == "while":
            return [self.called("body"), self.called("condition")]
        if self.op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
            return re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else \
                [self.called("true_computation"), self.called("false_computation")]
        if self.op in ("call", "async-start"):
            return [self.called("to_apply") or self.called("calls")]
        return []


@dataclass
class Computation:
    name: str
    is_entry: bool
    instrs: dict[str, Instr] = field(default_factory=dict)
    root: Instr | None = None
    _users: dict[str, list[tuple[Instr, int]]] | None = None

    def users(self, name: str) -> list[tuple[Instr, int]]:
        """(user, operand index) pairs of the instruction `name`."""
        if self._users is None:
            self._users = {}
            for i in self.instrs.values():
                for k, o in enumerate(i.operands):
                    self._users.setdefault(o, []).append((i, k))
        return self._users.get(name, [])

    def param(self, index: int) -> Instr | None:
        return next((i for i in self.instrs.values() if i.op == "parameter" and i.operand_text == str(index)), None)


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `start`; -1 if none does."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return -1


def parse_hlo(hlo_text: str) -> dict[str, Computation]:
    """Computations by name, from `compiled.as_text()` or any HLO module text."""
    comps: dict[str, Computation] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = comps.setdefault(m.group(2), Computation(m.group(2), bool(m.group(1))))
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        rest = line[m.end():] if m else ""
        end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
        op = re.match(r"\s*([\w\-]+)\(", rest[end:]) if end > 0 else None
        if not op:
            continue
        close = _balanced(rest, end + op.end() - 1)
        if close < 0:  # a line we cannot read moves nothing, rather than failing the whole analysis
            continue
        operand_text = rest[end + op.end():close - 1].strip()
        ins = Instr(m.group(2), rest[:end], op.group(1), re.findall(r"%([\w.\-]+)", operand_text), operand_text,
                    rest[close:])
        current.instrs[ins.name] = ins
        if m.group(1):
            current.root = ins
    for comp in comps.values():
        if comp.root is None and comp.instrs:
            comp.root = list(comp.instrs.values())[-1]
    return comps


def largest_buffers(hlo_text: str, n: int = 5) -> list[tuple[str, str, float]]:
    """The `n` largest HBM buffers made by instructions of executed computations, as (name, type, bytes).

    Fusion insides are not buffers. Aliases (get-tuple-element, tuple, bitcast, while, a -start's tuple, ...)
    are skipped so that each buffer is named once, by what makes it. Entry parameters count: they are the
    weights and optimizer state that an out-of-memory message should name.
    """
    comps = parse_hlo(hlo_text)
    entry = next((c for c in comps.values() if c.is_entry), None)
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    seen, todo, out = set(), [entry.name], []
    while todo:
        comp = comps.get(todo.pop())
        if comp is None or comp.name in seen:
            continue
        seen.add(comp.name)
        for ins in comp.instrs.values():
            todo += [c for c in ins.callees() if c]
            if ins.op in _ALIASING_OPS or ins.op.endswith("-start") or (ins.op == "parameter" and not comp.is_entry):
                continue
            hbm = sum(leaf.bytes for leaf in ins.leaves if leaf.memory_space == 0)
            if hbm:
                out.append((ins.name, ins.type_str, hbm))
    return sorted(out, key=lambda t: -t[2])[:n]
