"""`launch.py plan`: the pipeline model (`asyncrl/plan`) from the command line.

    python launch.py plan --config-name v5p64_qwen3_8b               at target scale: compile the programs for the
                                                                     slice (launch.py aot), predict, sweep, plot
    python launch.py plan --config-name v5p64_qwen3_8b --from-aot benchmarks/results/aot.json
                                                                     the same from compiled rows (`launch.py aot
                                                                     --out`, or benchmarks/aot.py's results)
    python launch.py plan --from-run runs/NAME                       replay a finished run: predicted vs measured
    python launch.py plan --from-run runs/NAME --what-if replicas=2 max_lag=2 decode_batch=64
                                                                     the same run, changed
    python launch.py plan --from-run runs/NAME --sweep-admission [--lags 0 1 2 3 4]
                                                                     the admission policy: predicted throughput at
                                                                     each max_lag, beside the ESS the run measured
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import yaml

from asyncrl.plan.from_run import read_run, what_if
from asyncrl.plan.sim import simulate

_COMPARED = ("step_s", "trainer_busy", "inference_busy", "decode_occupancy", "dropped_lag_per_step")
_AOT_PROGRAMS = ["train_step", "weight_sync_cast", "decode", "prefill", "lora_merge"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--from-run", help="a run directory (metrics.jsonl, inference.jsonl, config.yaml)")
    p.add_argument("--what-if", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="with --from-run: layout fields to change: replicas, max_lag, decode_batch, ...")
    p.add_argument("--sweep-admission", action="store_true",
                   help="with --from-run: predicted throughput at each of --lags, with the run's measured ESS there")
    p.add_argument("--skip-steps", type=int, default=None, help="steps left out of the steady-state figures")
    p.add_argument("--from-aot", help="with a config: the JSON rows of `launch.py aot --out` (else it compiles)")
    p.add_argument("--efficiency", type=float, default=0.7, help="share of its roofline each program reaches")
    p.add_argument("--mean-len", type=float, default=None, help="mean completion tokens (default: half the budget)")
    p.add_argument("--tail", type=float, default=0.6, help="log-space spread of completion lengths (0: constant)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: inference.min_prefill_bucket)")
    p.add_argument("--lags", type=int, nargs="*", default=[0, 1, 2, 3, 4], help="max_lag values to sweep")
    p.add_argument("--steps", type=int, default=40, help="steps each simulation runs")
    p.add_argument("--png", help="with a config: the sweep's plot (default: runs/plan/<run name>.png)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", help="also write the JSON rows to this file")
    return p


def _changes(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"plan: --what-if {item!r}: expected FIELD=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def predicted_row(result: Any, dropped_lag_steps: int) -> dict[str, float]:
    r = result.row()
    r["dropped_lag_per_step"] = r.pop("dropped_lag") / max(dropped_lag_steps, 1)
    return r


def main(argv: Sequence[str]) -> int:
    args, rest = _parser().parse_known_args(list(argv))
    if not args.from_run:  # a preset is compiled for its TPU slice, by a compile-only client
        from asyncrl.aot.report import without_persistent_cache

        without_persistent_cache()
    if args.from_run:
        if rest:
            raise SystemExit(f"plan: --from-run takes no config arguments: {rest}")
        return _replay(args)
    return _target(args, rest)


def _replay(args: argparse.Namespace) -> int:
    replay = read_run(args.from_run, 3 if args.skip_steps is None else args.skip_steps)
    for note in replay.notes:
        print(f"note: {note}")
    runs = {"as run": replay.layout}
    if args.what_if:
        runs["what if " + " ".join(args.what_if)] = what_if(replay, **_changes(args.what_if))
    rows: list[dict[str, Any]] = [{"case": "measured", **replay.measured.row()}]
    for name, layout in runs.items():
        res = simulate(replay.times, replay.lengths, layout)
        rows.append({"case": name, **predicted_row(res, res.steps)})
    t = replay.times
    print(f"fed with: decode step {1e3 * t.decode_step.fixed:.2f} ms + {1e3 * t.decode_step.per_unit:.3f} ms/row, "
          f"prefill {1e3 * t.prefill.fixed:.1f} ms/call, train {1e3 * t.train_step.fixed:.1f} ms + "
          f"{1e6 * t.train_step.per_unit:.2f} us/token, sync cast {1e3 * t.sync_cast_s:.1f} ms, "
          f"replica pause {1e3 * t.sync_transfer_s:.1f} ms; lengths mean {replay.lengths.mean:.1f} "
          f"(n={len(replay.lengths.completions)}), prompt {replay.lengths.prompt}")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'case':<40}" + "".join(f"{k:>22}" for k in _COMPARED))
        for r in rows:
            print(f"{r['case'][:40]:<40}" + "".join(f"{r[k]:>22.3f}" for k in _COMPARED))
    out: dict[str, Any] = {"run": args.from_run, "rows": rows, "notes": replay.notes}
    if args.sweep_admission:
        out["admission"] = _admission(args, replay)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _admission(args: argparse.Namespace, replay: Any) -> dict[str, Any]:
    """Prints and returns the admission sweep of a run (`plan/admission.py`)."""
    import os

    from asyncrl.config.loader import load_run_config
    from asyncrl.plan.admission import adaptive_reach, measured_ess_by_lag, sweep_admission

    a = load_run_config(os.path.join(args.from_run, "config.yaml")).async_
    rows = sweep_admission(replay, args.from_run, args.lags)
    reach = adaptive_reach(measured_ess_by_lag(args.from_run), a.ess_target, max(args.lags))
    print(f"\nadmission: predicted throughput by max_lag, and the ESS this run measured at each lag "
          f"(async.ess_target {a.ess_target:g})")
    print(f"{'max_lag':>8}{'step s':>10}{'trained tok/s':>15}{'lag mean':>10}{'ESS measured':>14}{'groups':>8}")
    for r in rows:
        ess = "-" if r["ess_measured"] is None else f"{r['ess_measured']:.3f}"
        print(f"{r['max_lag']:>8}{r['step_s']:>10.3f}{r['trained_tokens_per_s']:>15.0f}{r['lag_mean']:>10.2f}"
              f"{ess:>14}{r['groups_measured']:>8.0f}")
    if reach is None:
        print("adaptive: this run trained no stale group (max_lag 0): it says nothing of the ESS a lag costs")
    else:
        print(f"adaptive: on this run's ESS it would settle at max_lag {reach} (every lag up to it measured at or "
              f"above {a.ess_target:g}; lags the run never reached are not assumed)")
    return {"rows": rows, "ess_target": a.ess_target, "adaptive_reach": reach}


def _aot_rows(path: str, rest: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of `launch.py aot --out` (a list), or of the config's plain entry in `benchmarks/aot.py`'s results
    (a dict of entries, each with its config name and overrides)."""
    from asyncrl.config.loader import split_config_name
    from asyncrl.plan.target import PlanError

    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list) and all(isinstance(r, dict) and "program" in r for r in data):
        return data
    entries = [e for e in data.values() if isinstance(e, dict) and "rows" in e] if isinstance(data, dict) else []
    if not entries:
        raise PlanError(f"{path}: neither the rows of `launch.py aot --out` nor entries of benchmarks/aot.py")
    name, overrides = split_config_name(rest)
    for entry in entries:
        if entry.get("config") == name and list(entry.get("overrides", [])) == list(overrides):
            return entry["rows"]
    raise PlanError(f"{path}: no entry for config {name!r} with overrides {list(overrides)}")


def _target(args: argparse.Namespace, rest: Sequence[str]) -> int:
    import os

    from asyncrl.config.loader import load_config, split_config_name
    from asyncrl.plan.target import (
        Assumptions,
        PlanError,
        Target,
        closed_form_share,
        describe,
        format_points,
        plot,
        slots_note,
        sweep,
    )
    from asyncrl.validate import ConfigError

    if args.what_if:
        raise SystemExit("plan: --what-if goes with --from-run; with a config, change the config (overrides)")
    try:
        cfg = load_config(*split_config_name(rest))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        assume = Assumptions(efficiency=args.efficiency, mean_len=args.mean_len, tail=args.tail,
                             prompt_len=args.prompt_len, steps=args.steps,
                             skip_steps=5 if args.skip_steps is None else args.skip_steps)
        if args.from_aot:
            rows = _aot_rows(args.from_aot, rest)
        else:
            if cfg.run.tpu_topology is None:
                print("plan: the config sets no run.tpu_topology (and no --from-aot was given)", file=sys.stderr)
                return 2
            from asyncrl.aot.report import json_rows, run_aot
            from asyncrl.cli.aot import programs_config

            progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
            rows = json_rows(run_aot(programs_config(cfg), cfg.run.tpu_topology, _AOT_PROGRAMS, progress))
        t0 = time.perf_counter()
        target = Target.of(cfg, rows, assume)
        fed = describe(target)
        print(fed)
        print(slots_note(target))
        points = sweep(target, args.lags)
    except (PlanError, OSError, json.JSONDecodeError) as e:
        print(f"launch.py plan: {e}", file=sys.stderr)
        return 2
    here = next(p for p in points if p.train_workers == cfg.async_.train_workers and p.max_lag == cfg.async_.max_lag) \
        if cfg.async_.max_lag in args.lags else None
    print(f"\n{cfg.run.name}: the sweep (each point {assume.steps} steps, the first {assume.skip_steps} left out)")
    print(format_points(points))
    if here is not None:
        r = here.result
        print(f"\nas configured (train_workers {here.train_workers}, max_lag {here.max_lag}): step {r.step_s:.3f} s, "
              f"trainer busy {r.trainer_busy:.2f}, inference busy {r.inference_busy:.2f}, decode occupancy "
              f"{r.decode_occupancy:.2f}, {r.dropped_lag} groups dropped for lag, "
              f"{r.generated_tokens_per_s_per_chip:.0f} generated tokens/s per chip")
    share = closed_form_share(target)
    chips = cfg.run.hosts * cfg.run.devices_per_host
    print(f"closed-form roofline split (launch.py roofline --from-aot): {100 * share:.1f}% of the chips train "
          f"({share * chips:.1f} of {chips})")
    png = args.png or os.path.join("runs", "plan", f"{cfg.run.name}.png")
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    plot(points, target, png)
    print(f"plot: {png}  ({time.perf_counter() - t0:.1f} s after the aot step)")
    if args.json:
        print(json.dumps([p.row() for p in points], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": cfg.run.name, "assumptions": assume.__dict__, "describe": fed,
                       "closed_form_train_share": share, "points": [p.row() for p in points]}, f, indent=1)
    return 0
