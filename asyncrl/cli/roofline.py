"""`launch.py roofline`: the roofline model of `asyncrl/aot/roofline.py` from the command line, with chip and
model presets, or from the compiled per-step figures of `launch.py aot --out FILE` (`asyncrl/aot/split.py`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from asyncrl.aot.roofline import CHIPS, RooflineError, RooflineResult, roofline

_FLAGS = {
    "params": "--params", "kv_bytes_per_token": "--kv-bytes-per-token", "seq_len": "--seq-len",
    "decode_batch": "--decode-batch", "rollout_fraction": "--rollout-fraction", "chip_flops": "--chip-flops",
    "chip_bandwidth": "--chip-bandwidth", "chips": "--chips", "chips_per_host": "--chips-per-host",
    "chip_hbm_bytes": "--chip-hbm", "from_aot": "--from-aot",
}

# (argparse dest, flag, where a preset can supply it)
_REQUIRED = (
    ("params", "--params", "--model"),
    ("kv_bytes_per_token", "--kv-bytes-per-token", "--model"),
    ("seq_len", "--seq-len", None),
    ("decode_batch", "--decode-batch", None),
    ("rollout_fraction", "--rollout-fraction", None),
    ("chip_flops", "--chip-flops", "--chip"),
    ("chip_bandwidth", "--chip-bandwidth", "--chip"),
    ("chips", "--chips", None),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="roofline",
        description="Split chips between trainer and inference with the blog's roofline model "
        "(r = lambda C/(6M) (K T/P + 2/B_d), train share = 1/(1+r)). Explicit flags override presets.",
    )
    p.add_argument("--model",
                   help="model preset from asyncrl.models.config.PRESETS; fills --params and --kv-bytes-per-token")
    p.add_argument("--chip", help=f"chip preset, one of {sorted(CHIPS)}; fills --chip-flops, --chip-bandwidth, "
                   "--chip-hbm, --chips-per-host")
    p.add_argument("--params", type=float, help="P: parameter count, e.g. 8e9")
    p.add_argument("--kv-bytes-per-token", type=float, help="K: KV-cache bytes per token over all layers")
    p.add_argument("--kv-bytes-per-value", type=int, default=2, help="KV element size used with --model (2 = bf16)")
    p.add_argument("--seq-len", type=int, help="T: sequence length (prompt + completion)")
    p.add_argument("--decode-batch", type=int, help="B_d: in-flight decode batch per inference chip")
    p.add_argument("--rollout-fraction", type=float, help="lambda: mean fraction of T a rollout reaches, in (0, 1]")
    p.add_argument("--chip-flops", type=float, help="C: dense bf16 FLOP/s per chip")
    p.add_argument("--chip-bandwidth", type=float, help="M: HBM bytes/s per chip")
    p.add_argument("--chip-hbm", type=float, help="HBM bytes per chip, to check that B_d fits (optional)")
    p.add_argument("--chips", type=int, help="A: total chips in the slice")
    p.add_argument("--chips-per-host", type=int, help="chips per host, for the host split (async.train_workers)")
    p.add_argument("--from-aot", metavar="FILE",
                   help="use the compiled per-step figures that `launch.py aot --out FILE` wrote (train step and "
                   "decode roofline times) instead of the formulas; --rollout-fraction "
                   "defaults to 0.5, --chips to the whole slice")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    values = {dest: getattr(args, dest) for dest, _, _ in _REQUIRED}
    values["chips_per_host"] = args.chips_per_host
    values["chip_hbm_bytes"] = args.chip_hbm
    if args.chip is not None:
        spec = CHIPS.get(args.chip.lower())
        if spec is None:
            parser.error(f"--chip {args.chip!r} is unknown; known chips: {sorted(CHIPS)}")
        layout = spec.chips_per_host_for(values["chips"]) if values["chips"] is not None else spec.chips_per_host
        for dest, preset_value in (("chip_flops", spec.flops), ("chip_bandwidth", spec.bandwidth),
                                   ("chips_per_host", layout), ("chip_hbm_bytes", spec.hbm_bytes)):
            if values[dest] is None:
                values[dest] = preset_value
    if args.model is not None:
        # Imported here: the models package pulls in jax, which the arithmetic does not need.
        from asyncrl.models.config import PRESETS

        cfg = PRESETS.get(args.model)
        if cfg is None:
            parser.error(f"--model {args.model!r} is unknown; known models: {sorted(PRESETS)}")
        if values["params"] is None:
            values["params"] = float(cfg.num_params())
        if values["kv_bytes_per_token"] is None:
            values["kv_bytes_per_token"] = float(cfg.kv_bytes_per_token(args.kv_bytes_per_value))
    missing = [
        flag + (f" (or {preset})" if preset else "") for dest, flag, preset in _REQUIRED if values[dest] is None
    ]
    if missing:
        parser.error("missing required value(s): " + ", ".join(missing))
    return values


def format_table(res: RooflineResult) -> str:
    lines = [
        f"inputs  P={res.params:.3g}  K={res.kv_bytes_per_token:,.0f} B/token  T={res.seq_len}  "
        f"B_d={res.decode_batch}  lambda={res.rollout_fraction:g}",
        f"chips   A={res.chips}  C={res.chip_flops / 1e12:g} TFLOP/s  M={res.chip_bandwidth / 1e9:g} GB/s",
        f"  {'r (decode / train work)':<34}{res.r:.3f}",
        f"  {'train share X/A':<34}{100 * res.train_share:.1f}%  ({res.ideal_train_chips:.1f} of {res.chips} chips)",
        f"  {'chips   train / inference':<34}{res.train_chips} / {res.inference_chips}"
        f"  ({100 * res.chip_split.efficiency:.1f}% of ideal, {res.chip_split.bottleneck}-bound)",
    ]
    if res.max_decode_batch is not None:
        lines.append(f"  {'max B_d that fits HBM':<34}{res.max_decode_batch}")
    if res.host_split is not None and res.valid_host_split is not None:
        hs, vs = res.host_split, res.valid_host_split
        lines += [
            f"  {'hosts   train / inference':<34}{hs.train_hosts} / {hs.inference_hosts}"
            f"  ({res.chips_per_host} chips/host, {res.hosts} hosts; {100 * hs.efficiency:.1f}% of ideal)",
            f"  {f'async.train_workers (divides {res.hosts})':<34}{res.train_workers}"
            f"  -> {vs.train_hosts} / {vs.inference_hosts} hosts ({100 * vs.efficiency:.1f}% of ideal)",
        ]
    lines += [f"warning: {w}" for w in res.warnings]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`launch.py roofline ...`: argparse errors exit with status 2 and name the offending flag."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_aot:
        from asyncrl.aot.split import main as from_aot

        try:
            return from_aot(args.from_aot, 0.5 if args.rollout_fraction is None else args.rollout_fraction,
                            args.chips, args.chips_per_host, args.json)
        except RooflineError as e:
            parser.error(f"{_FLAGS[e.field]}: {e}")
    values = _resolve(parser, args)
    try:
        res = roofline(**values)
    except RooflineError as e:
        parser.error(f"{_FLAGS[e.field]}: {e}")
    print(json.dumps(res.to_dict()) if args.json else format_table(res))
    return 0
