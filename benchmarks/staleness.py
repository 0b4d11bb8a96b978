"""Learning under staleness (issue #39): fixed max_lag 0, 1 and 4 against adaptive admission, side by side.

Each setting runs a preset through `python launch.py` (a local Ray cluster), `--seeds` seeds each, in a setting
where a high fixed lag hurts (by default the local default with a higher learning rate). Per run it reads
RUN_DIR/metrics.jsonl and reports the last held-out eval (eval/pass@1 by default), the mean step time over the
steps after the first (which compiles), the groups dropped (for lag and for ESS), the mean admitted lag, and the
mean measured ESS of the trained groups (`staleness/ess_mean`); then the mean over seeds of each setting.

    PYTHONPATH=. .venv/bin/python benchmarks/staleness.py [--config-name default] [--seeds 0 1] [--steps 150]
        [--lr 3e-3] [--settings fixed0 fixed1 fixed4 adaptive] [overrides ...]

Smoke test (seconds of work per run, nothing to conclude from): `--steps 3 --seeds 0 --settings fixed0 adaptive`.
Writes benchmarks/results/staleness.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe, machine  # noqa: E402

# name -> overrides. 'adaptive' may reach max_lag 4, starting on-policy (staleness.Admission).
SETTINGS = {
    "fixed0": ["async.max_lag=0"],
    "fixed1": ["async.max_lag=1"],
    "fixed4": ["async.max_lag=4"],
    "adaptive": ["async.max_lag=4", "async.admission=adaptive", "async.ess_target=0.9", "async.ess_floor=0.5"],
}


def read_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def summarize(rows: list[dict], eval_key: str) -> dict[str, float | None]:
    """One run's figures from its metrics rows (the step rows; eval rows carry `eval_key`)."""
    steps = [r for r in rows if "step_time_s" in r]
    evals = [r[eval_key] for r in rows if eval_key in r]
    mean = lambda key, rs: float(np.mean([r[key] for r in rs if key in r])) if any(key in r for r in rs) else None  # noqa: E731
    return {
        "steps": len(steps),
        "eval": float(evals[-1]) if evals else None,
        "step_time_s": mean("step_time_s", steps[1:] or steps),
        "dropped_lag": float(sum(r.get("rollout/filtered_lag", 0.0) for r in steps)),
        "dropped_ess": float(sum(r.get("rollout/filtered_ess", 0.0) for r in steps)),
        "admitted_lag_mean": mean("rollout/lag_mean", steps),
        "ess_mean": mean("staleness/ess_mean", steps),
        "ahead_mean": mean("admission/ahead", steps),
    }


def run_one(config: str, setting: str, seed: int, steps: int, lr: float, run_dir: str, extra: list[str]) -> float:
    """Runs one setting and seed; returns its wall time."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS")}
    cmd = [sys.executable, "launch.py", "--config-name", config, f"run.run_dir={run_dir}", f"run.seed={seed}",
           f"train.total_steps={steps}", f"train.lr={lr}", "logging.ray_metrics=false", "logging.tensorboard=false",
           *SETTINGS[setting], *extra]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{setting} seed {seed}: launch.py exited with {res.returncode}")
    return time.perf_counter() - t0


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-name", default="default", help="the preset: default (the local default) or lookup")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=3e-3, help="higher than the preset's, so that stale groups hurt")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--eval-key", default="eval/pass@1")
    ap.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench-staleness"))
    ap.add_argument("--out", default=str(HERE / "results" / "staleness.json"))
    args, extra = ap.parse_known_args(argv)
    info = machine()
    print(f"machine: {describe(info)}", flush=True)
    runs: dict[str, list[dict]] = {setting: [] for setting in args.settings}
    for seed in args.seeds:  # seed by seed: a drift of the machine's speed over the hour reaches every setting alike
        for setting in args.settings:
            run_dir = os.path.join(args.runs_dir, f"{args.config_name}-{setting}-s{seed}")
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                sys.exit(f"{run_dir} already has a run; pass another --runs-dir")
            wall = run_one(args.config_name, setting, seed, args.steps, args.lr, run_dir, extra)
            runs[setting].append({"seed": seed, "run_dir": run_dir, "wall_s": wall, "load_1m_after": os.getloadavg()[0],
                                  **summarize(read_rows(run_dir), args.eval_key)})
    result = {"machine": info, "config": args.config_name, "steps": args.steps, "lr": args.lr, "overrides": extra,
              "runs": runs, "mean": {}}
    print(f"\n{args.config_name}, {args.steps} steps, lr {args.lr}, seeds {args.seeds}")
    print(f"{'setting':<10}{'eval':>8}{'step s':>9}{'dropped lag':>13}{'dropped ess':>13}{'admitted lag':>14}"
          f"{'ESS':>7}")
    for setting, rs in runs.items():
        avg = {k: (float(np.mean([r[k] for r in rs])) if all(r[k] is not None for r in rs) else None)
               for k in ("eval", "step_time_s", "dropped_lag", "dropped_ess", "admitted_lag_mean", "ess_mean")}
        result["mean"][setting] = avg
        print(f"{setting:<10}{fmt(avg['eval'], '.3f'):>8}{fmt(avg['step_time_s'], '.3f'):>9}"
              f"{fmt(avg['dropped_lag'], '.1f'):>13}{fmt(avg['dropped_ess'], '.1f'):>13}"
              f"{fmt(avg['admitted_lag_mean'], '.2f'):>14}{fmt(avg['ess_mean'], '.3f'):>7}")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
