"""`launch.py plan`: the pipeline model (`asyncrl/plan`) from the command line.

    python launch.py plan --from-run runs/NAME                       replay a finished run: predicted vs measured
    python launch.py plan --from-run runs/NAME --what-if replicas=2 max_lag=2 decode_batch=64
                                                                     the same run, changed
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

import yaml

from asyncrl.plan.from_run import read_run, what_if
from asyncrl.plan.sim import simulate

_COMPARED = ("step_s", "trainer_busy", "inference_busy", "decode_occupancy", "dropped_lag_per_step")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--from-run", required=True, help="a run directory (metrics.jsonl, inference.jsonl, config.yaml)")
    p.add_argument("--what-if", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="layout fields to change: replicas, max_lag, decode_batch, prompts_per_step, overlap, ...")
    p.add_argument("--skip-steps", type=int, default=3, help="steps left out of the steady-state figures")
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
    args = _parser().parse_args(list(argv))
    replay = read_run(args.from_run, args.skip_steps)
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"run": args.from_run, "rows": rows, "notes": replay.notes}, f, indent=1)
    return 0
