"""`launch.py plan` against real runs here: the pipeline model, fed with each run's own logged program timings and
lengths (`asyncrl/plan/from_run.py`), predicts the run's step time, busy shares, decode occupancy and lag drops.

Four layouts of the local default (the tiny model on the digits task), each run for real and then replayed:
max_lag 0, 1 and 2 with one inference host, and max_lag 2 with two (3 hosts). Evals and checkpoints are off (the
model has no eval rounds) and every step's rollouts are logged (the length distribution).

    PYTHONPATH=. .venv/bin/python benchmarks/plan_validate.py [--steps 60] [--only lag1]

Goal (issue #26): step time within 15%, busy shares within 10 points. Writes benchmarks/results/plan_validate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.cli.plan import predicted_row  # noqa: E402
from asyncrl.plan.from_run import read_run  # noqa: E402
from asyncrl.plan.sim import simulate  # noqa: E402
from benchmarks.machine import describe, machine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {
    "lag0": ["async.max_lag=0"],
    "lag1": ["async.max_lag=1"],
    "lag2": ["async.max_lag=2"],
    "lag2_2inf": ["async.max_lag=2", "run.hosts=3"],
}
KEYS = ("step_s", "trainer_busy", "inference_busy", "decode_occupancy", "dropped_lag_per_step")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", nargs="*", default=list(CASES))
    ap.add_argument("--runs-dir", default="runs/plan_validate")
    ap.add_argument("--reuse", action="store_true", help="replay existing run directories instead of running")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan_validate.json"))
    args = ap.parse_args()
    info = machine()
    print(f"machine: {describe(info)}")
    out = {"machine": info, "steps": args.steps, "cases": {}, "reused_runs": args.reuse}
    if args.reuse:  # the runs were measured when they ran: keep that record; `machine` is this replay's
        try:
            with open(args.out) as f:
                prev = json.load(f)
            out["runs_machine"] = prev.get("runs_machine", prev["machine"])
        except (OSError, json.JSONDecodeError, KeyError):
            out["runs_machine"] = None
    for name in args.only:
        run_dir = os.path.join(args.runs_dir, name)
        if not args.reuse:
            cmd = [sys.executable, "launch.py", *CASES[name], f"train.total_steps={args.steps}", "eval.every_n_steps=0",
                   "checkpoint.every_n_steps=0", "logging.rollouts_every_n_steps=1", f"run.run_dir={run_dir}"]
            t0 = time.time()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-3000:])
                raise SystemExit(f"{name}: the run failed ({' '.join(cmd)})")
            print(f"{name}: ran in {time.time() - t0:.0f} s")
        replay = read_run(run_dir)
        sim = simulate(replay.times, replay.lengths, replay.layout)
        pred = predicted_row(sim, sim.steps)
        meas = replay.measured.row()
        out["cases"][name] = {"overrides": CASES[name], "measured": meas, "predicted": pred,
                              "times": {k: vars(t) if hasattr(t, "__dict__") else t
                                        for k in replay.times.__dataclass_fields__
                                        for t in [getattr(replay.times, k)]},
                              "lengths_mean": replay.lengths.mean, "notes": replay.notes}
    print(f"\n{'case':<11}" + "".join(f"{k:>24}" for k in KEYS))
    for name, c in out["cases"].items():
        for kind in ("measured", "predicted"):
            print(f"{name if kind == 'measured' else '':<11}" + "".join(f"{c[kind][k]:>24.3f}" for k in KEYS)
                  + f"  {kind}")
        err = (c["predicted"]["step_s"] - c["measured"]["step_s"]) / c["measured"]["step_s"]
        c["step_s_error"] = err
        c["busy_error_points"] = {k: 100 * (c["predicted"][k] - c["measured"][k])
                                  for k in ("trainer_busy", "inference_busy")}
        print(f"{'':<11}step time {100 * err:+.1f}%, trainer busy {c['busy_error_points']['trainer_busy']:+.1f} pts, "
              f"inference busy {c['busy_error_points']['inference_busy']:+.1f} pts")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
