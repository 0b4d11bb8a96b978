"""The report of `launch.py aot` (`asyncrl/cli/aot.py`): compile a run's programs for a TPU slice on any machine,
and say whether they fit and how fast they can be.

For each program (`programs.py`) the compiled executable gives per-chip memory (`memory_analysis`) and the
compiled HLO, from which `hlo_cost.py` reads loop-weighted FLOPs, HBM bytes and collective bytes. With the chip's
peak numbers (the `roofline` table) that gives:

    roofline_s = max(flops / peak_flops, hbm_bytes / hbm_bandwidth)        what the compiled program needs
    ideal_s    = max(ideal_flops / peak_flops, ideal_bytes / hbm_bandwidth)  what the work itself needs
    ratio      = ideal_s / roofline_s

For the train step the ratio is the MFU ceiling: ideal_flops is 6·N·tokens, so remat's recomputed forward and
attention's FLOPs count as overhead, not as useful work. For a decode step it is the traffic ratio: the ideal
reads the weights and the whole KV cache once. Collective time is not in the roofline (it can overlap); the
collective bytes are reported beside it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.aot.libtpu import quiet_libtpu_without_tpu
from asyncrl.aot.roofline import CHIPS, ChipSpec

if TYPE_CHECKING:  # the programs module builds a Trainer and an engine: imported when the programs are built
    from asyncrl.aot.programs import ProgramsConfig

GiB = 2**30

# Usable HBM per chip as the TPU compiler reports it in its out-of-memory message (libtpu 0.0.42.1): what a
# program can really use, a little under the datasheet figure.
USABLE_HBM = {"v5p": 95.74 * GiB, "v6e": 31.25 * GiB, "v5e": 15.75 * GiB}
TOPOLOGY_RE = re.compile(r"^(v5p|v6e|v5e):\d+(x\d+)+$")


class AotError(RuntimeError):
    pass


@dataclass
class Row:
    program: str
    topology: str
    role: str
    chips: int
    per: str
    tokens: int
    seq_len: int
    fits: bool
    peak_bytes_per_chip: float
    hbm_bytes_per_chip: float
    argument_bytes: float = 0.0
    output_bytes: float = 0.0
    alias_bytes: float = 0.0
    temp_bytes: float = 0.0
    code_bytes: float = 0.0
    flops: float = 0.0
    matmul_flops: float = 0.0
    hbm_bytes_accessed: float = 0.0
    roofline_s: float = 0.0
    ideal_s: float = 0.0
    ratio: float = 0.0
    collective_bytes: dict[str, float] = field(default_factory=dict)
    unknown_trip_counts: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    error: str | None = None
    largest_buffers: list[tuple[str, str, float]] = field(default_factory=list)


GPU_TARGET_RE = re.compile(r"^(gpu|cuda|nvidia|[abhl]\d+|b200|gb200)\b", re.IGNORECASE)


def gpu_target_error(topology: str) -> str | None:
    """None unless `topology` names a GPU; then why it cannot be compiled for. XLA compiles for a TPU slice with
    no TPU through libtpu's topology descriptions; jax 0.10.2 has no such description for CUDA without the CUDA
    plugin and a device ("topology not implemented for cuda"), so a GPU target is refused, with the probe's own
    answer."""
    if not GPU_TARGET_RE.match(topology):
        return None
    import jax
    from jax.experimental import topologies

    try:
        topologies.get_topology_desc(platform="cuda", topology_name=topology)
        why = "jax can describe it, but the report's chip table (aot/roofline.py) covers TPU chips only"
    except Exception as e:  # noqa: BLE001 - the reason is the message
        why = f"XLA cannot compile for a GPU without one (jax {jax.__version__}: {str(e).splitlines()[0]})"
    return (f"--topology {topology!r} names a GPU: {why}. `launch.py aot` compiles for TPU slices (e.g. v5p:2x4x4); "
            "on a GPU, measure the programs instead: python benchmarks/gpu.py")


def chip_of(topology: str) -> tuple[str, ChipSpec, float]:
    gpu = gpu_target_error(topology)
    if gpu:
        raise AotError(gpu)
    if not TOPOLOGY_RE.match(topology):
        raise AotError(f"--topology {topology!r}: expected e.g. v5p:2x4x4, v6e:2x4 or v5e:2x4 (libtpu's names)")
    kind = topology.split(":")[0]
    return kind, CHIPS[kind], USABLE_HBM[kind]


def without_persistent_cache() -> None:
    """Called first by the compile-only commands (`aot`, `plan`), each its own process. A compile-only client
    cannot load an executable back ("PjRtCompiler must be constructed with a Client to call
    DeserializeLoadedExecutable"), so with a persistent compilation cache set (JAX_COMPILATION_CACHE_DIR) every
    program after the first run printed a warning and saved nothing. JAX reads the setting once per process, at its
    first compile: this is a no-op where something already compiled."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


def topology_devices(topology: str) -> list[Any]:
    """The devices of a TPU slice, from libtpu's topology description (no TPU needed)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's lock file would refuse a second process
    quiet_libtpu_without_tpu()
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # noqa: BLE001 - libtpu missing or an unknown name: say which and how to fix
        raise AotError(f"cannot load TPU topology {topology!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                       "install libtpu with `pip install -r requirements-tpu.txt`") from e


_OOM = re.compile(r"required for (?P<what>[\w ]+?) \((?P<need>[\d.]+)(?P<u1>[KMGT]?)\) exceeds available HBM "
                  r"\((?P<have>[\d.]+)(?P<u2>[KMGT]?)\)")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _parse_oom(msg: str) -> tuple[float, float] | None:
    m = _OOM.search(msg)
    if not m:
        return None
    return float(m["need"]) * _UNIT[m["u1"]], float(m["have"]) * _UNIT[m["u2"]]


def compile_row(program: Any, topology: str) -> Row:
    """Compile one program and read its figures; a program that does not fit gives fits=False, not an exception."""
    from asyncrl.aot import hlo_cost, hlo_text

    _, chip, hbm = chip_of(topology)
    row = Row(program.name, topology, program.role, program.chips, program.per, program.tokens, program.seq_len, True,
              0.0, hbm)
    t0 = time.perf_counter()
    lowered = program.lower()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - only RESOURCE_EXHAUSTED is a result; anything else propagates
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        row.compile_s = time.perf_counter() - t0
        row.fits, row.error = False, str(e).splitlines()[0]
        parsed = _parse_oom(str(e))
        if parsed:
            row.peak_bytes_per_chip = parsed[0]
        row.largest_buffers = hlo_text.largest_buffers(_oom_hlo(lowered), 5)
        return row
    row.compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    row.argument_bytes, row.output_bytes = float(m.argument_size_in_bytes), float(m.output_size_in_bytes)
    row.alias_bytes, row.temp_bytes = float(m.alias_size_in_bytes), float(m.temp_size_in_bytes)
    row.code_bytes = float(m.generated_code_size_in_bytes)
    row.peak_bytes_per_chip = float(m.peak_memory_in_bytes)
    row.fits = row.peak_bytes_per_chip <= hbm
    text = compiled.as_text()
    cost = hlo_cost.analyze_hlo(text)
    row.flops, row.matmul_flops, row.hbm_bytes_accessed = cost.flops, cost.matmul_flops, cost.hbm_bytes
    row.collective_bytes = {k: v for k, v in cost.collective_bytes.items() if v}
    row.unknown_trip_counts = list(cost.unknown_trip_counts)
    row.roofline_s = max(cost.flops / chip.flops, cost.hbm_bytes / chip.bandwidth)
    row.ideal_s = max(program.ideal_flops / chip.flops, program.ideal_bytes / chip.bandwidth)
    row.ratio = row.ideal_s / row.roofline_s if row.roofline_s else 0.0
    if not row.fits:
        row.largest_buffers = hlo_text.largest_buffers(text, 5)
    return row


def _oom_hlo(lowered: Any) -> str:
    """The per-chip optimized program of a lowering that ran out of memory: XLA still writes it (and its memory
    report) when asked to dump, though it returns no executable. Falls back to the unpartitioned HLO."""
    import glob
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="asyncrl-aot-oom-")
    try:
        try:
            lowered.compile(compiler_options={"xla_dump_to": d})
        except Exception:  # noqa: BLE001 - it fails again, as expected; the dump is what we want
            pass
        dumps = sorted(glob.glob(os.path.join(d, "*after_optimizations.txt")))
        if dumps:
            with open(dumps[-1]) as f:
                return f.read()
        return lowered.compiler_ir("hlo").as_hlo_text()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _size(x: float) -> str:
    """Binary units, as HBM capacities are quoted."""
    for s, f in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(x) >= f:
            return f"{x / f:.2f}{s}"
    return f"{x:.0f}"


def _si(x: float, unit: str) -> str:
    for s, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.2f} {s}{unit}"
    return f"{x:.0f} {unit}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def format_table(rows: Sequence[Row]) -> str:
    head = ["program", "chips", "args", "out", "alias", "temp", "code", "peak", "HBM", "headroom", "fits",
            "FLOPs", "HBM bytes", "roofline ms", "ideal ms", "ratio", "collectives"]
    lines = []
    for r in rows:
        coll = ", ".join(f"{k} {_si(v, 'B')}" for k, v in sorted(r.collective_bytes.items())) or "-"
        cells = [r.program, str(r.chips), _size(r.argument_bytes), _size(r.output_bytes), _size(r.alias_bytes),
                 _size(r.temp_bytes), _size(r.code_bytes), _size(r.peak_bytes_per_chip), _size(r.hbm_bytes_per_chip),
                 _size(r.hbm_bytes_per_chip - r.peak_bytes_per_chip), "yes" if r.fits else "NO",
                 _si(r.flops, "F"), _si(r.hbm_bytes_accessed, "B"), _ms(r.roofline_s), _ms(r.ideal_s),
                 f"{r.ratio:.2f}", coll]
        if r.error:  # no executable: only the compiler's figure for the memory it needed is known
            cells = [c if i in (0, 1, 7, 8, 9, 10) else "-" for i, c in enumerate(cells)]
        lines.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i in (0, 16) else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
    return "\n".join(out)


def json_rows(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def failure_message(r: Row) -> str:
    short = r.peak_bytes_per_chip - r.hbm_bytes_per_chip
    bufs = "; ".join(f"{name} {shape} ({_gib(b)} GiB)" for name, shape, b in r.largest_buffers) or "unknown"
    return (f"{r.program} does not fit on {r.topology}: needs {_gib(r.peak_bytes_per_chip)} GiB per chip, "
            f"{_gib(r.hbm_bytes_per_chip)} GiB usable, short by {_gib(short)} GiB. Largest buffers: {bufs}.")


def run_aot(cfg: ProgramsConfig, topology: str, only: Sequence[str] | None = None, log: Any = None) -> list[Row]:
    from asyncrl.aot.programs import build_programs

    chip_of(topology)
    devices = topology_devices(topology)
    programs = build_programs(cfg, devices, only)
    rows = []
    for i, p in enumerate(programs):
        if log:
            log(f"[{i + 1}/{len(programs)}] compiling {p.name} over {p.chips} {topology.split(':')[0]} chips ...")
        rows.append(compile_row(p, topology))
        if log:
            log(f"      {rows[-1].compile_s:.1f}s, peak {_gib(rows[-1].peak_bytes_per_chip)} GiB per chip")
    return rows
