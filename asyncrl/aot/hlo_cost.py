"""Loop-weighted, per-chip cost of a compiled XLA program, read from its compiled HLO text.

`compiled.cost_analysis()` counts a while body once, so a program that scans over layers, chunks a loss or
accumulates gradients in a loop is under-counted by its trip counts. Here each executed computation is
weighted by how often it runs: a while body by its trip count (the while's `known_trip_count` backend config
or, failing that, solved from the condition's compare of the counter against a constant, with the counter's
start and step read from the loop state and the body), nested loops multiplying. A compiled SPMD program is
one chip's program, so every figure is per chip.

What is counted, per execution:
- `matmul_flops`: 2 * output elements * contracted elements for every dot; for every convolution
  2 * output elements * kernel input features * kernel window (padding not subtracted). Fusions included. Each
  counts its MXU passes: an f32 dot at `Precision.HIGH` runs as 3 bf16 passes and at `HIGHEST` as 6, so it counts
  3x or 6x (XLA counts it once). The flash-attention kernels' matmuls are counted here too, causal: see
  `kernel_cost.py` (the kernels' own estimates are wrong: full non-causal attention forward, nothing backward).
- `flops`: `matmul_flops` plus one per output element of each elementwise op (convert and compare too),
  (input - output elements) per reduce, and the `cost_estimate` any other Pallas kernel (tpu_custom_call) declares.
  That is XLA's rule, so a loop-free program matches `cost_analysis()["flops"]`. `transcendentals` (exp,
  log, tanh, ...) are apart, as in XLA.
- `hbm_bytes`: for each instruction of an executed computation (entry, while bodies and conditions, called
  and async-wrapped computations), operand bytes plus output bytes, as XLA's "bytes accessed". A fusion
  counts at its boundary: its insides stay in vregs and VMEM. Refinements that follow traffic, not buffers:
  * A fusion operand that the fusion only slices (slice, dynamic-slice, gather; through bitcasts and nested
    fusions) counts the slices: a scanned layer reads its own weights, not the whole stack. A slice is
    sized in the operand's dtype; XLA sizes TPU's converting slice (an f32 stack read as bf16 layers) by
    its output dtype, half of what is read.
  * A dynamic-update-slice updates in place: its buffer is neither read nor rewritten, only the update is.
  * Bytes are split by memory space, `S(n)` in the layout. Only space 0, HBM, counts here; the others go to
    `other_memory_bytes` (on TPU 1 is VMEM, 5 pinned host). An async copy counts once, at its copy-done:
    the source read in its space and the result written in its space.
  * AllocateBuffer custom-calls only reserve memory and count nothing.
  Sizes include TPU tile padding (the layout's first tile: `T(8,128)` rounds the two most minor physical
  dims up to 8 and 128), as XLA's do. Metadata ops (parameter, get-tuple-element, tuple, constant,
  bitcast, ...) count nothing; while, conditional, call and async-start count their bodies instead. A
  conditional counts, figure by figure, its most expensive branch: an upper bound, as which runs is unknown.
- `collective_bytes`: per kind, the payload of each collective: the larger of its input and output bytes,
  i.e. the whole buffer gathered, reduced or exchanged. A ring moves about (n-1)/n of it per chip for
  all-gather and reduce-scatter and twice that for all-reduce. An async pair (`all-gather-start` and
  `-done`) counts once, at the -done; one pipelined across loop iterations counts only its result. TPU fuses
  reduce-scatter as an all-reduce whose result each chip dynamic-slices (a kCustom fusion); that is reported as
  reduce-scatter. Collectives under the named scope `moe` (a mixture-of-experts layer's dispatch and combine,
  `models/moe.py`) are counted a second time under "<kind> (moe)", so that they can be told from FSDP's.

Against `cost_analysis()["bytes accessed"]` (the tests measure it): on a loop-free program whose arguments
stay in HBM the two agree exactly. Where XLA prefetches an argument into VMEM before the program runs
(copy-start / copy-done), XLA counts every memory space and counts the copy's tuple output (destination
and source alias) besides the copy-done's output, so its figure is about `hbm_bytes` + VMEM bytes + twice
the prefetched bytes; `hbm_bytes` is the same with or without the prefetch.

A loop whose trip count is data-dependent (a `fori_loop` up to a traced bound) cannot be read. Where it runs under
a named scope `worst_case_trips_<n>` (its while's `op_name` metadata contains that), it is weighted by n: the
code that opens the scope states the loop's largest trip count (cached attention's loop over KV blocks, which
stops at the longest live row: n = blocks in the whole cache, see `models/attention.py`), so the figures stay an
upper bound per call. Such loops are named in `assumed_trip_counts`. Any other loop whose trip count cannot be
read is weighted 1 and named in `unknown_trip_counts`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from asyncrl.aot.hlo_text import Computation, Instr, Leaf, dtype_bytes, parse_hlo
from asyncrl.aot.kernel_cost import FLASH_KERNEL, conv_macs, flash_cost, mxu_passes

_METADATA_OPS = frozenset("parameter get-tuple-element tuple constant bitcast after-all partition-id replica-id "
                          "opt-barrier add-dependency domain".split())
_TRANSCENDENTAL_OPS = frozenset("exponential exponential-minus-one log log-plus-one tanh logistic sqrt rsqrt cbrt "
                                "power sine cosine tan atan2 erf".split())
_ELEMENTWISE_OPS = frozenset(
    "add subtract multiply divide remainder maximum minimum abs negate sign floor ceil round-nearest-afz "
    "round-nearest-even compare select clamp convert and or xor not shift-left shift-right-arithmetic "
    "shift-right-logical popcnt count-leading-zeros is-finite real imag complex stochastic-convert".split())
_COLLECTIVES = frozenset("all-gather all-reduce reduce-scatter all-to-all collective-permute collective-broadcast "
                         "ragged-all-to-all".split())
_SLICING_OPS = frozenset({"slice", "dynamic-slice", "gather"})

_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_MOE_SCOPE = re.compile(r'op_name="[^"]*/moe/')  # a mixture-of-experts layer's dispatch and combine (models/moe.py)
_WORST_CASE = re.compile(r'op_name="[^"]*worst_case_trips_(\d+)/while"')
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


class Loop(NamedTuple):
    """A while loop of the program; depth 0 is outermost. trip_count is None where it could not be read."""

    name: str
    trip_count: int | None
    depth: int


@dataclass(frozen=True)
class ProgramCost:
    """Per-chip cost of one execution of a compiled program, each loop body weighted by its trip count."""

    flops: float
    matmul_flops: float
    transcendentals: float
    hbm_bytes: float
    other_memory_bytes: dict[int, float]  # memory space -> bytes (TPU: 1 VMEM, 5 pinned host)
    collective_bytes: dict[str, float]  # kind -> payload bytes
    loops: tuple[Loop, ...]
    unknown_trip_counts: tuple[str, ...]  # while instructions weighted 1 for want of a trip count
    assumed_trip_counts: tuple[str, ...] = ()  # data-dependent loops weighted by their scope's stated worst case




class _Acc:
    """Additive figures: "flops", "matmul_flops", "transcendentals", ("mem", space), ("coll", kind)."""

    def __init__(self) -> None:
        self.c: dict[Any, float] = {}
        self.loops: list[Loop] = []

    def inc(self, key: Any, n: float) -> None:
        self.c[key] = self.c.get(key, 0.0) + n

    def add(self, o: _Acc, w: float = 1.0, combine: Any = None) -> None:
        for k, v in o.c.items():
            self.c[k] = combine(self.c.get(k, 0.0), v) if combine else self.c.get(k, 0.0) + w * v
        self.loops += o.loops


class _Analyzer:
    def __init__(self, hlo_text: str) -> None:
        self.comps = parse_hlo(hlo_text)
        self._memo: dict[tuple[str, str], Any] = {}
        self.assumed: list[str] = []
        self.entry = next((c for c in self.comps.values() if c.is_entry), None)
        if self.entry is None:
            raise ValueError("HLO text has no ENTRY computation")

    def _shape(self, comp: Computation, name: str) -> list[Leaf]:
        return comp.instrs[name].leaves if name in comp.instrs else []

    def _instr_flops(self, comp: Computation, ins: Instr) -> tuple[float, float, float]:
        """(matmul flops, other flops, transcendentals) of one instruction, a fusion's insides included."""
        if ins.op == "fusion":
            return self._fused(ins.called("calls"), "flops")
        out = sum(math.prod(leaf.dims) for leaf in ins.leaves)
        if ins.op in ("dot", "convolution"):
            lhs, rhs = (self._shape(comp, o) for o in (ins.operands + ["", ""])[:2])
            contracting = re.search(r"lhs_contracting_dims=\{([\d,\s]*)\}", ins.attrs)
            labels = re.search(r"dim_labels=\w*_(\w+)->", ins.attrs)
            passes = mxu_passes(ins.attrs, lhs[0].dtype if lhs else "", rhs[0].dtype if rhs else "")
            if ins.op == "dot" and lhs and contracting:
                k = math.prod(lhs[0].dims[int(d)] for d in contracting.group(1).split(",") if d.strip())
            elif ins.op == "convolution" and lhs and rhs and labels:
                return passes * 2.0 * conv_macs(ins.attrs, ins.leaves[0].dims, lhs[0].dims, rhs[0].dims), 0.0, 0.0
            else:
                k = 1
            return passes * 2.0 * out * k, 0.0, 0.0
        if ins.op == "custom-call" and FLASH_KERNEL.search(ins.name):
            q, k = (self._shape(comp, o) for o in (ins.operands + ["", ""])[:2])
            return flash_cost(ins.name, q[0].dims if q else (), k[0].dims if k else ())
        if ins.op == "custom-call":  # a Pallas kernel states its own cost
            est = re.search(r'"cost_estimate"\s*:\s*\{([^}]*)\}', ins.attrs)
            fl, tr = (re.search(rf'"{key}"\s*:\s*"?(\d+)', est.group(1)) if est else None
                      for key in ("flops", "transcendentals"))
            return 0.0, float(fl.group(1)) if fl else 0.0, float(tr.group(1)) if tr else 0.0
        if ins.op in _TRANSCENDENTAL_OPS:
            return 0.0, 0.0, float(out)
        if ins.op in _ELEMENTWISE_OPS:
            return 0.0, float(out), 0.0
        if ins.op == "reduce":
            inputs = ins.operands[:len(ins.operands) // 2]
            return 0.0, float(max(0, sum(math.prod(x.dims) for o in inputs for x in self._shape(comp, o)) - out)), 0.0
        return 0.0, 0.0, 0.0

    def _fused(self, name: str | None, what: str) -> Any:
        """Memoized flops triple, or {kind: payload} of collectives, inside a fused computation."""
        if (name, what) not in self._memo:
            comp = self.comps.get(name or "")
            instrs = list(comp.instrs.values()) if comp else []
            if what == "flops":
                parts = [self._instr_flops(comp, i) for i in instrs]
                self._memo[name, what] = tuple(sum(p[j] for p in parts) for j in range(3))
            else:
                found = _Acc()
                for i in instrs:
                    if i.op == "fusion":
                        for kind, n in self._fused(i.called("calls"), what).items():
                            found.inc(kind, n)
                    elif i.op in _COLLECTIVES:
                        users = comp.users(i.name)
                        kind = "reduce-scatter" if i.op == "all-reduce" and users and all(
                            u.op == "dynamic-slice" for u, _ in users) else i.op
                        read = sum(x.bytes for o in i.operands for x in self._shape(comp, o))
                        found.inc(kind, max(read, sum(x.bytes for x in i.leaves)))
                self._memo[name, what] = found.c
        return self._memo[name, what]

    def _param_read_bytes(self, fused: str | None, index: int, full: float) -> float:
        """Bytes a fusion reads of operand `index`: the slices it takes if it only slices it, else all."""
        comp = self.comps.get(fused or "")
        param = comp.param(index) if comp else None
        if param is None:
            return full
        total, frontier = 0.0, [param]
        while frontier:
            node = frontier.pop()
            if node is comp.root:  # it flows out whole
                return full
            for user, k in comp.users(node.name):
                if user.op == "bitcast":
                    frontier.append(user)
                elif user.op in _SLICING_OPS and k == 0:
                    total += math.prod(user.leaves[0].dims) * dtype_bytes(node.leaves[0].dtype)
                elif user.op == "fusion":
                    total += self._param_read_bytes(user.called("calls"), k, full)
                elif not (user.op == "dynamic-update-slice" and k == 0):
                    return full
        return min(total, full)

    def _read_bytes(self, comp: Computation, ins: Instr) -> list[tuple[int, float]]:
        """(memory space, bytes) read per operand."""
        reads = []
        for k, o in enumerate(ins.operands):
            leaves = self._shape(comp, o)
            full = sum(x.bytes for x in leaves)
            if not leaves:
                continue
            if ins.op == "fusion":
                full = self._param_read_bytes(ins.called("calls"), k, full)
            elif ins.op in _SLICING_OPS and k == 0:
                full = min(full, math.prod(ins.leaves[0].dims) * dtype_bytes(leaves[0].dtype))
            elif ins.op == "dynamic-update-slice" and k == 0:
                full = 0.0
            reads.append((leaves[0].memory_space, full))
        return reads

    def _write_bytes(self, comp: Computation, ins: Instr) -> list[tuple[int, float]]:
        """(memory space, bytes) written per output; a dynamic-update-slice writes only its update."""
        roots = [ins]
        if ins.op == "fusion" and ins.called("calls") in self.comps:
            comp = self.comps[ins.called("calls")]
            root = self._skip_bitcasts(comp, comp.root)
            roots = [self._skip_bitcasts(comp, comp.instrs.get(o)) for o in root.operands] \
                if root is not None and root.op == "tuple" else [root]
        leaves = ins.leaves
        if len(roots) != len(leaves):
            roots = [None] * len(leaves)
        return [(leaf.memory_space, sum(x.bytes for x in self._shape(comp, r.operands[1]))
                 if r is not None and r.op == "dynamic-update-slice" else leaf.bytes) for leaf, r in zip(leaves, roots)]

    @staticmethod
    def _skip_bitcasts(comp: Computation, ins: Instr | None) -> Instr | None:
        while ins is not None and ins.op == "bitcast" and ins.operands[0] in comp.instrs:
            ins = comp.instrs[ins.operands[0]]
        return ins

    def walk(self, name: str | None, depth: int = 0) -> _Acc:
        """Figures of one run of an executed computation, its loops weighted by their trip counts."""
        acc, comp = _Acc(), self.comps.get(name or "")
        for ins in comp.instrs.values() if comp else ():
            op = ins.op
            if op in _METADATA_OPS or 'custom_call_target="AllocateBuffer"' in ins.attrs:
                continue
            if op == "while":
                trip = self.trip_count(comp, ins)
                worst = _WORST_CASE.search(ins.attrs)
                if trip is None and worst:
                    trip = int(worst.group(1))
                    self.assumed.append(ins.name)
                acc.loops.append(Loop(ins.name, trip, depth))
                body, cond = ins.callees()
                acc.add(self.walk(body, depth + 1), 1 if trip is None else trip)
                acc.add(self.walk(cond, depth + 1), 1 if trip is None else trip + 1)
                continue
            if op == "conditional":
                worst = _Acc()
                for branch in ins.callees():
                    worst.add(self.walk(branch, depth), combine=max)
                acc.add(worst)
                continue
            if ins.callees() and ins.callees()[0] in self.comps:
                acc.add(self.walk(ins.callees()[0], depth))
                continue
            if op in ("async-update", "async-done") or (op.endswith("-start") and op != "async-start"):
                continue  # counted at the -done
            start = comp.instrs.get(ins.operands[0]) if op.endswith("-done") and ins.operands else None
            if op.endswith("-done"):  # its inputs are its -start's, unless that ran in an earlier iteration
                reads = self._read_bytes(comp, start) if start is not None and start.op.endswith("-start") else []
            else:
                reads = self._read_bytes(comp, ins)
            writes = self._write_bytes(comp, ins)
            for space, n in reads + writes:
                acc.inc(("mem", space), n)
            kind = op.removesuffix("-done")
            moe = _MOE_SCOPE.search((start or ins).attrs) is not None
            if kind in _COLLECTIVES:
                n = max(sum(n for _, n in reads), sum(n for _, n in writes))
                acc.inc(("coll", kind), n)
                if moe:
                    acc.inc(("coll", f"{kind} (moe)"), n)
            if op == "fusion":
                for kind, n in self._fused(ins.called("calls"), "collectives").items():
                    acc.inc(("coll", kind), n)
                    if moe and not kind.endswith("(moe)"):
                        acc.inc(("coll", f"{kind} (moe)"), n)
            mm, fl, tr = self._instr_flops(comp, ins)
            acc.inc("matmul_flops", mm)
            acc.inc("flops", mm + fl)
            acc.inc("transcendentals", tr)
        return acc

    def trip_count(self, comp: Computation, ins: Instr) -> int | None:
        """`known_trip_count`, else solved from the condition's compare of the counter against a constant."""
        m = _TRIP.search(ins.attrs)
        if m:
            return int(m.group(1))
        body, cond = (self.comps.get(c or "") for c in ins.callees())
        cmp, scope = (cond.root, (cond, None)) if cond else (None, None)
        if cmp is not None and cmp.op == "fusion" and cmp.called("calls") in self.comps:
            fused = self.comps[cmp.called("calls")]
            cmp, scope = fused.root, (fused, (cond, cmp))
        direction = re.search(r"direction=(\w+)", cmp.attrs) if cmp is not None and cmp.op == "compare" else None
        if not direction:
            return None
        a, b = (self._resolve(scope, o) for o in cmp.operands[:2])
        d = direction.group(1)
        if a and b and a[0] == "const" and b[0] == "index":
            a, b, d = b, a, _FLIP[d]
        if not (a and b and a[0] == "index" and b[0] == "const"):
            return None
        state = comp.instrs.get(ins.operands[0]) if ins.operands else None
        init = self._resolve((comp, None), state.operands[a[1]]) \
            if state is not None and state.op == "tuple" and a[1] < len(state.operands) else None
        init = init[1] if init and init[0] == "const" else 0  # where scans and fori_loops start
        step = self._step(body, a[1])
        span = {"LT": b[1] - init, "NE": b[1] - init, "LE": b[1] - init + 1,
                "GT": init - b[1], "GE": init - b[1] + 1}.get(d)
        if span is None or (d in ("GT", "GE")) != (step < 0):
            return None
        return max(0, -(-span // abs(step)))

    def _resolve(self, scope: tuple[Computation, Any], name: str) -> tuple[str, int] | None:
        """("const", value) or ("index", loop-state tuple index) that `name` evaluates to, if either."""
        comp, outer = scope
        ins = comp.instrs.get(name)
        for _ in range(16):
            if ins is None:
                return None
            if ins.op == "constant":
                v = re.fullmatch(r"-?\d+", ins.operand_text)
                return ("const", int(v.group(0))) if v else None
            if ins.op == "get-tuple-element" and getattr(comp.instrs.get(ins.operands[0]), "op", "") == "parameter":
                return "index", int(re.search(r"index=(\d+)", ins.attrs).group(1))
            if ins.op == "parameter" and outer is not None:  # a fused condition's parameter: its caller's operand
                (comp, caller), outer = outer, None
                ins = comp.instrs.get(caller.operands[int(ins.operand_text)])
                continue
            if ins.op not in ("copy", "bitcast", "convert", "reshape"):
                return None
            ins = comp.instrs.get(ins.operands[0])
        return None

    def _step(self, body: Computation | None, index: int) -> int:
        """The counter's increment in the body; 1 where it cannot be read."""
        root = body.root if body is not None else None
        upd = body.instrs.get(root.operands[index]) if root is not None and root.op == "tuple" \
            and index < len(root.operands) else None
        if upd is not None and upd.op in ("add", "subtract"):
            r = [self._resolve((body, None), o) for o in upd.operands[:2]]
            consts = [x[1] for x in r if x and x[0] == "const"]
            if consts and ("index", index) in r:
                return consts[0] if upd.op == "add" else -consts[0]
        return 1


def analyze_hlo(hlo_text: str) -> ProgramCost:
    """Loop-weighted per-chip cost of the program in `hlo_text` (see the module docstring)."""
    analyzer = _Analyzer(hlo_text)
    acc = analyzer.walk(analyzer.entry.name)
    c = acc.c
    return ProgramCost(
        flops=c.get("flops", 0.0), matmul_flops=c.get("matmul_flops", 0.0),
        transcendentals=c.get("transcendentals", 0.0), hbm_bytes=c.get(("mem", 0), 0.0),
        other_memory_bytes={k[1]: v for k, v in c.items() if k[0] == "mem" and k[1] != 0},
        collective_bytes={k[1]: v for k, v in c.items() if k[0] == "coll"},
        loops=tuple(acc.loops), unknown_trip_counts=tuple(lp.name for lp in acc.loops if lp.trip_count is None),
        assumed_trip_counts=tuple(analyzer.assumed))


def analyze(compiled: Any) -> ProgramCost:
    """`analyze_hlo` of a `jax.stages.Compiled`, from `jax.jit(f).lower(...).compile()`."""
    return analyze_hlo(compiled.as_text())
