"""Is a run bit-identical to the same run on an earlier commit? (issue #39: `async.admission=fixed` with
`train.ess_scaled_lr` off must train exactly as before those options existed, at max_lag 0.)

Runs the same `python launch.py` (the local default at `async.max_lag=0` unless told otherwise) on this tree and on
`--ref` (checked out in a git worktree of its own), `--steps` steps each, with a checkpoint at the last step and every
step's rollouts logged, and compares:
- every step's metrics that are values of the training, not of the clock (times, waits, rates, memory left out);
- every trained completion's text and reward;
- the parameters saved at the last step, bytewise.
With `--repeat`, this tree runs twice as well: a difference between two runs of the same code would make the
comparison meaningless (at max_lag 0 the pipeline is synchronous, so it should not happen).

    PYTHONPATH=. .venv/bin/python benchmarks/same_as_before.py --ref e67e653^ [--steps 30] [--repeat] [overrides ...]

Writes benchmarks/results/same_as_before.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Metrics of the clock, not of the training: they differ between any two runs. `inference/` rows are the replicas'
# counters as last reported when the step ended (decode steps, rows finished, version): a snapshot in time.
CLOCK = re.compile(r"(time|_s$|_s_|_ms|per_s|wait|rpc|queue|mem|busy|occupancy|straggler|compile|bytes|gib|^time$"
                   r"|carried|in_flight|pid|^inference/)", re.I)


def run(tree: str, run_dir: str, steps: int, overrides: list[str]) -> float:
    cmd = [sys.executable, "launch.py", f"train.total_steps={steps}", f"run.run_dir={run_dir}",
           f"checkpoint.every_n_steps={steps}", "checkpoint.resume=false", "logging.rollouts_every_n_steps=1",
           "logging.progress=false", *overrides]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
    if res.returncode != 0:
        print(res.stderr[-4000:])
        raise SystemExit(f"the run in {tree} failed: {' '.join(cmd)}")
    return time.time() - t0


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "step" in r]


def completions(run_dir: str) -> list[tuple]:
    with open(os.path.join(run_dir, "rollouts.jsonl")) as f:
        return [(r["step"], r["id"], c["text"], c["reward"]) for r in map(json.loads, f) if "completions" in r
                for c in r["completions"]]


def params(run_dir: str, step: int) -> dict[str, np.ndarray]:
    import jax
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"), item_names=("state", "meta"))
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    mgr.close()
    flat = jax.tree_util.tree_flatten_with_path(out["state"]["params"])[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def compare(a: str, b: str, steps: int) -> dict:
    ma, mb = metrics(a), metrics(b)
    keys = sorted({k for r in ma for k in r} & {k for r in mb for k in r})
    value_keys = [k for k in keys if not CLOCK.search(k) and k != "step"]
    differ = sorted({k for ra, rb in zip(ma, mb) for k in value_keys
                     if k in ra and k in rb and ra[k] != rb[k]})
    ca, cb = completions(a), completions(b)
    pa, pb = params(a, steps), params(b, steps)
    worst = max(float(np.abs(pa[k].astype(np.float64) - pb[k]).max()) for k in pa) if pa.keys() == pb.keys() \
        else float("inf")
    return {"steps": [len(ma), len(mb)], "metric_keys_compared": len(value_keys), "metrics_differ": differ,
            "completions": [len(ca), len(cb)], "completions_equal": ca == cb,
            "params_equal_bytes": pa.keys() == pb.keys() and all(pa[k].tobytes() == pb[k].tobytes() for k in pa),
            "params_max_abs_diff": worst}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="the commit to compare with (e.g. the one before the option)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", action="store_true", help="also run this tree twice")
    ap.add_argument("--reuse", action="store_true", help="compare the runs already in --runs-dir")
    ap.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "same_as_before"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "same_as_before.json"))
    ap.add_argument("overrides", nargs="*", default=["async.max_lag=0"])
    args = ap.parse_args()
    sha = subprocess.run(["git", "rev-parse", args.ref], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "asyncrl", "configs", "launch.py"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    ref_tree = os.path.join("/tmp", f"asyncrl-ref-{sha[:10]}")
    if not os.path.isdir(ref_tree):
        subprocess.run(["git", "worktree", "add", "--detach", ref_tree, sha], cwd=ROOT, check=True)
    runs = {"ref": (ref_tree, sha), "head": (ROOT, here)}
    if args.repeat:
        runs["head_again"] = (ROOT, here)
    out: dict = {"ref": sha, "head": here, "head_dirty": dirty, "steps": args.steps, "overrides": args.overrides,
                 "wall_s": {}}
    for name, (tree, _) in runs.items():
        run_dir = os.path.join(args.runs_dir, name)
        if args.reuse:
            continue
        subprocess.run(["rm", "-rf", run_dir], check=True)
        out["wall_s"][name] = round(run(tree, run_dir, args.steps, args.overrides), 1)
        print(f"{name}: {out['wall_s'][name]} s")
    d = lambda name: os.path.join(args.runs_dir, name)  # noqa: E731
    out["head_vs_ref"] = compare(d("head"), d("ref"), args.steps)
    if args.repeat:
        out["head_vs_head"] = compare(d("head"), d("head_again"), args.steps)
    for k in ("head_vs_ref", "head_vs_head"):
        if k in out:
            print(f"{k}: {json.dumps(out[k])}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    same = out["head_vs_ref"]
    return 0 if not same["metrics_differ"] and same["completions_equal"] and same["params_equal_bytes"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
