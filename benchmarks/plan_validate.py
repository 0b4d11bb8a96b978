"""`launch.py plan` against real runs here: the pipeline model, fed with each run's own logged program timings and
lengths (`asyncrl/plan/from_run.py`), predicts the run's step time, busy shares, decode occupancy and lag drops.

Four layouts of the local default (the tiny model on the digits task), each run for real and then replayed:
max_lag 0, 1 and 2 with one inference host, and max_lag 2 with two (3 hosts). Evals and checkpoints are off (the
model has no eval rounds) and every step's rollouts are logged (the length distribution).

    PYTHONPATH=. .venv/bin/python benchmarks/plan_validate.py [--steps 60] [--only lag1]

Goal (issue #26): step time within 15%, busy shares within 10 points. Writes benchmarks/results/plan_validate.json.

Cross mode (issue #39): does a replay predict a run it has not seen? Five runs of the local default with its format
warm-start off (long, varied completions): max_lag 0, 1 (the default) and 2, and the default's decode batch halved
and doubled. Each lag run is fitted and predicts the other two through `what_if`; the default predicts the two
batches and each batch the default. Each pair under several models: `today` (the fitted costs as measured, no
contention term), and `shareX` (solo costs, processor sharing, each busy process asking for X of the machine's
cores; X = `PROCESS_SHARE`, 1, is what `launch.py plan` does, `--shares` adds others: 0.6 and 0.75). Goal:
step time within 15% both ways. About 5-7 minutes on a 2-core machine (the five runs, ~1 min each; the replays
take under a minute). Writes benchmarks/results/plan_cross.json.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_validate.py --cross [--steps 60] [--reuse]
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
CROSS_COMMON = ["train.format_warmstart_steps=0"]
KEYS = ("step_s", "trainer_busy", "inference_busy", "decode_occupancy", "dropped_lag_per_step")


def _launch(name: str, overrides: list[str], steps: int, run_dir: str) -> None:
    cmd = [sys.executable, "launch.py", *overrides, f"train.total_steps={steps}", "eval.every_n_steps=0",
           "checkpoint.every_n_steps=0", "logging.rollouts_every_n_steps=1", f"run.run_dir={run_dir}"]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:])
        raise SystemExit(f"{name}: the run failed ({' '.join(cmd)})")
    print(f"{name}: ran in {time.time() - t0:.0f} s", flush=True)


def cross_cases() -> dict[str, tuple[list[str], dict]]:
    """name -> (the run's overrides, the layout fields a what-if sets to predict it)."""
    from asyncrl.config.loader import load_config

    cfg = load_config("default", [])
    b, lag = cfg.inference.max_decode_batch_size, cfg.async_.max_lag  # the batch what-ifs keep the default's lag
    out = {f"lag{k}": ([f"async.max_lag={k}"], {"max_lag": k, "decode_batch": b}) for k in (0, 1, 2)}
    for n in (b // 2, 2 * b):
        out[f"batch{n}"] = ([f"async.max_lag={lag}", f"inference.max_decode_batch_size={n}"],
                            {"max_lag": lag, "decode_batch": n})
    return out


def cross_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every lag run predicts the other lags; the default predicts the batches, each batch the default."""
    from asyncrl.config.loader import load_config

    default = f"lag{load_config('default', []).async_.max_lag}"
    lags = [n for n in names if n.startswith("lag")]
    pairs = [(a, b) for a in lags for b in lags if a != b]
    return pairs + [p for n in names if n.startswith("batch") for p in ((default, n), (n, default))]


def cross(args: argparse.Namespace, info: dict) -> int:
    from asyncrl.plan.from_run import PROCESS_SHARE, what_if

    cases = cross_cases()
    for name, (overrides, _) in cases.items():
        if not args.reuse:
            _launch(name, overrides + CROSS_COMMON, args.steps, os.path.join(args.runs_dir, name))
    cores = os.cpu_count() or 1
    # The models: no contention term (the costs as measured), then shared cores, each busy process asking for a
    # share of the machine (`PROCESS_SHARE` is what `launch.py plan` uses; the others show how much it matters).
    shares = sorted({*args.shares, PROCESS_SHARE})
    demand = {"today": (0.0, None), **{f"share{x:g}": (None, x * cores) for x in shares}}
    models = list(demand)
    replays = {m: {n: read_run(os.path.join(args.runs_dir, n), shared_cores=demand[m][0],
                               process_cores=demand[m][1]) for n in cases} for m in models}
    default = f"share{PROCESS_SHARE:g}"
    out = {"machine": info, "steps": args.steps, "reused_runs": args.reuse, "process_share": PROCESS_SHARE,
           "models": {m: {"shared_cores": replays[m]["lag0"].layout.shared_cores,
                          "process_cores": replays[m]["lag0"].layout.trainer_cores} for m in models},
           "runs": {n: {"overrides": cases[n][0] + CROSS_COMMON, "measured": replays["today"][n].measured.row(),
                        "notes": replays[default][n].notes,
                        "train_step_solo": vars(replays[default][n].times.train_step),
                        "train_step_measured": vars(replays["today"][n].times.train_step)} for n in cases},
           "pairs": []}
    print(f"\n{'fitted on':<11}{'predicts':<11}{'measured s':>11}" + "".join(f"{m + ' s':>13}{'err':>7}"
                                                                          for m in models))
    for a, b in cross_pairs(list(cases)):
        meas = replays["today"][b].measured.step_s
        row = {"fitted_on": a, "predicts": b, "measured_step_s": meas}
        for m in models:
            rep = replays[m][a]
            res = simulate(rep.times, rep.lengths, what_if(rep, **cases[b][1]))
            row[m] = {"step_s": res.step_s, "ratio": res.step_s / meas, "trainer_busy": res.trainer_busy,
                      "inference_busy": res.inference_busy}
        out["pairs"].append(row)
        print(f"{a:<11}{b:<11}{meas:>11.3f}" + "".join(f"{row[m]['step_s']:>13.3f}{100 * (row[m]['ratio'] - 1):>+6.0f}%"
                                                     for m in models))
    for m in models:
        worst = max(abs(r[m]["ratio"] - 1) for r in out["pairs"])
        out[f"worst_error_{m}"] = worst
        print(f"{m}: worst step-time error {100 * worst:.0f}% ({'within' if worst <= 0.15 else 'outside'} 15%)")
    path = args.out or os.path.join(HERE, "results", "plan_cross.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", nargs="*", default=list(CASES))
    ap.add_argument("--runs-dir", default=None, help="default: runs/plan_validate (runs/plan_cross with --cross)")
    ap.add_argument("--reuse", action="store_true", help="replay existing run directories instead of running")
    ap.add_argument("--cross", action="store_true", help="fit each run and predict the others (issue #39)")
    ap.add_argument("--shares", type=float, nargs="*", default=[0.6, 0.75],
                    help="with --cross: shares of the machine a busy process asks for, each a model besides today's")
    ap.add_argument("--out", default=None, help="default: results/plan_validate.json (plan_cross.json with --cross)")
    args = ap.parse_args()
    info = machine()
    print(f"machine: {describe(info)}")
    if args.cross:
        args.runs_dir = args.runs_dir or "runs/plan_cross"
        return cross(args, info)
    args.runs_dir = args.runs_dir or "runs/plan_validate"
    args.out = args.out or os.path.join(HERE, "results", "plan_validate.json")
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
            _launch(name, CASES[name], args.steps, run_dir)
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
