"""`launch.py roofline --from-aot FILE`: the blog's train/inference split, from compiled programs, not formulas.

The blog's model charges a sequence alpha = 6 T P / C chip-seconds to train and beta = lambda T (B_d T K + 2 P) /
(M B_d) to generate. `launch.py aot --out FILE` writes what the compiled programs really need on the target
chip (their loop-weighted roofline times), so both come from there instead:

    alpha = train_step.roofline_s x train chips / sequences per step
    beta  = lambda x T x decode.roofline_s x decode chips / rows per decode step

and the same integer allocation follows (`roofline.allocate`). Prefill is left out, as in the blog: one prefill
per prompt against lambda T decode steps per sample.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from asyncrl.aot.roofline import CHIPS, RooflineError, Split, allocate


@dataclass(frozen=True)
class AotSplit:
    topology: str
    chips: int
    chips_per_host: int
    rollout_fraction: float
    train_chip_seconds_per_sequence: float
    inference_chip_seconds_per_sequence: float
    r: float
    train_share: float
    chip_split: Split
    host_split: Split | None
    train_workers: int | None
    valid_host_split: Split | None
    warnings: tuple[str, ...]


def split_from_aot(rows: list[dict[str, Any]], rollout_fraction: float = 0.5, chips: int | None = None,
                   chips_per_host: int | None = None) -> AotSplit:
    """`rows`: the JSON rows of `launch.py aot` (one config on one topology). `chips` defaults to the whole slice."""
    by_name = {r["program"]: r for r in rows}
    for need in ("train_step", "decode"):
        if need not in by_name:
            raise RooflineError("from_aot", f"--from-aot: no {need!r} row (rerun `launch.py aot` without --programs)")
        if not by_name[need]["fits"]:
            raise RooflineError("from_aot", f"--from-aot: {need} does not fit on {by_name[need]['topology']}")
    if not 0 < rollout_fraction <= 1:
        raise RooflineError("rollout_fraction", f"rollout_fraction={rollout_fraction} must be in (0, 1]")
    train, decode = by_name["train_step"], by_name["decode"]
    topology = train["topology"]
    kind, dims = topology.split(":")
    chips = chips or math.prod(int(d) for d in dims.split("x"))
    chips_per_host = chips_per_host or CHIPS[kind].chips_per_host_for(chips)
    alpha = train["roofline_s"] * train["chips"] * train["seq_len"] / train["tokens"]
    beta = rollout_fraction * decode["seq_len"] * decode["roofline_s"] * decode["chips"] / decode["tokens"]
    chip_split, _, host_split, valid, train_workers, warnings = allocate(alpha, beta, chips, chips_per_host)
    return AotSplit(topology, chips, chips_per_host, rollout_fraction, alpha, beta, beta / alpha,
                    1 / (1 + beta / alpha), chip_split, host_split, train_workers, valid, tuple(warnings))


def format_split(s: AotSplit) -> str:
    lines = [
        f"from compiled programs on {s.topology} ({s.chips} chips, {s.chips_per_host} per host), "
        f"lambda={s.rollout_fraction:g}",
        f"  {'train chip-s per sequence':<34}{s.train_chip_seconds_per_sequence:.4g}",
        f"  {'decode chip-s per sequence':<34}{s.inference_chip_seconds_per_sequence:.4g}",
        f"  {'r (decode / train work)':<34}{s.r:.3f}",
        f"  {'train share X/A':<34}{100 * s.train_share:.1f}%",
        f"  {'chips   train / inference':<34}{s.chip_split.train_chips} / {s.chip_split.inference_chips}"
        f"  ({100 * s.chip_split.efficiency:.1f}% of ideal, {s.chip_split.bottleneck}-bound)",
    ]
    if s.valid_host_split is not None:
        v = s.valid_host_split
        lines.append(f"  {'async.train_workers':<34}{s.train_workers}  -> {v.train_hosts} / {v.inference_hosts} hosts "
                     f"({100 * v.efficiency:.1f}% of ideal, {v.bottleneck}-bound)")
    lines += [f"warning: {w}" for w in s.warnings]
    return "\n".join(lines)


def main(path: str, rollout_fraction: float, chips: int | None, chips_per_host: int | None, as_json: bool) -> int:
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RooflineError("from_aot", f"--from-aot {path}: cannot read ({e})") from e
    res = split_from_aot(rows, rollout_fraction, chips, chips_per_host)
    if as_json:
        from dataclasses import asdict

        print(json.dumps(asdict(res)))
    else:
        print(format_split(res))
    return 0
