"""Multi-turn decode throughput against single-turn, at equal generated tokens, with a slow environment.

The engine alone (no Ray, no trainer): the tiny model, a batch of prompts, each sample an episode of TURNS model
turns separated by an environment step that sleeps ENV_S (a tool, a game) before it answers with a short
observation; against the same prompts decoded in one turn of TURNS x the per-turn budget (the baseline, same
generated tokens, no environment). Reported for both: generated tokens/s over the wall time, and decode-slot
occupancy, the share of the decode batch's row-steps that held a live row (`EngineStats.slot_steps`), and the same
share of the wall time (a slot idles while its engine has nothing to decode: waiting on environments, extends and
prefills count as idle).

    python benchmarks/multiturn.py [--env-s 0.5] [--prompts 96] [--turns 3] [--tokens-per-turn 16] [--parked 128]

Writes benchmarks/results/multiturn.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.models import Model, preset  # noqa: E402
from asyncrl.rollout import Prompt, StepResult  # noqa: E402


class SleepyEnv:
    """Answers every turn with `obs` after `delay_s`, until the last turn."""

    stop: tuple = ()

    def __init__(self, prompt, obs, delay_s):
        self.prompt, self.obs, self.delay_s = prompt, obs, delay_s

    def reset(self):
        return list(self.prompt)

    def step(self, turn):
        time.sleep(self.delay_s)
        if turn.last:
            return StepResult(None, 1.0, True, "correct")
        return StepResult(self.obs, 0.0, False)


def run(engine: Engine, requests: list[Request]) -> dict[str, float]:
    s0 = dict(vars(engine.stats))
    t0 = time.perf_counter()
    out = engine.generate(requests, drain=True)
    wall = time.perf_counter() - t0
    s = engine.stats
    model_tokens = sum(len(c.tokens) - c.observation_tokens for r in out for c in r.completions)
    steps = s.decode_steps - s0["decode_steps"]
    slot_steps = s.slot_steps - s0["slot_steps"]
    B = engine.B
    return {"wall_s": wall, "generated_tokens": float(model_tokens), "tokens_per_s": model_tokens / wall,
            "slot_occupancy_steps": slot_steps / max(1, steps * B),
            "slot_occupancy_time": (s.slot_time - s0["slot_time"]) / (B * wall),
            "decode_s": s.decode_time - s0["decode_time"], "extend_s": s.extend_time - s0["extend_time"],
            "prefill_s": s.prefill_time - s0["prefill_time"], "env_s": s.env_time - s0["env_time"],
            "turns_mean": float(np.mean([c.n_turns for r in out for c in r.completions])),
            "parked_full": float(s.parked_full - s0["parked_full"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-s", type=float, default=0.5)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--parked", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "multiturn.json"))
    args = ap.parse_args()

    model = Model(preset("tiny"))
    params = model.init_params(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 90, size=int(rng.integers(6, 12))).tolist() for _ in range(args.prompts)]
    obs = rng.integers(10, 90, size=4).tolist()
    base = dict(group_size=args.group, max_decode_batch_size=args.batch, max_prefill_prompts=8, temperature=1.0,
                params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16)
    per_turn = args.tokens_per_turn
    span = args.turns * (per_turn + 1 + len(obs) + 1) + 16
    multi_cfg = InferenceConfig(**base, max_seq_len=64 * ((span + 63) // 64), max_turns=args.turns,
                                max_new_tokens=per_turn, max_parked_rows=args.parked)
    single_cfg = InferenceConfig(**base, max_seq_len=64 * ((span + 63) // 64), max_turns=1,
                                 max_new_tokens=args.turns * (per_turn + 1) - 1)
    # A random model samples this EOS about 1 token in 128: turns end mostly at their budget (max_new_tokens), so
    # both engines generate about the same tokens.
    eos = model.cfg.vocab_size - 1
    multi = Engine(model, params, multi_cfg, None, eos_id=eos, seed=0)
    single = Engine(model, params, single_cfg, None, eos_id=eos, seed=0)

    def requests(with_env: bool, offset: int):
        out = []
        for i, p in enumerate(prompts):
            envs = [SleepyEnv(p, obs, args.env_s) for _ in range(args.group)] if with_env else None
            out.append(Request(Prompt(offset + i, None, args.group), p, envs))
        return out

    # Warm-up: every program compiled (prefill and extend buckets, both decode programs), then measured.
    run(multi, requests(True, 0)[:4])
    run(single, requests(False, 0)[:4])
    rows = {"multi_turn": run(multi, requests(True, 10_000)), "single_turn": run(single, requests(False, 10_000))}
    ratio = rows["multi_turn"]["tokens_per_s"] / rows["single_turn"]["tokens_per_s"]
    machine = {"cpu": platform.processor() or platform.machine(), "load": os.getloadavg()[0],
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "devices": str(jax.devices()[0])}
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        machine["cpu"] = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
        flags = next(ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags"))
        machine["vector"] = " ".join(f for f in flags if f.startswith(("avx", "fma", "amx")))
    except (OSError, StopIteration):
        pass
    print(f"{'':14}{'wall s':>8}{'tokens':>9}{'tok/s':>9}{'slots busy (steps)':>20}{'(time)':>9}{'env s':>8}"
          f"{'extend s':>10}{'turns':>7}{'re-prefills':>13}")
    for name, r in rows.items():
        print(f"{name:14}{r['wall_s']:8.2f}{r['generated_tokens']:9.0f}{r['tokens_per_s']:9.0f}"
              f"{r['slot_occupancy_steps']:20.3f}{r['slot_occupancy_time']:9.3f}{r['env_s']:8.1f}{r['extend_s']:10.2f}"
              f"{r['turns_mean']:7.2f}{r['parked_full']:13.0f}")
    print(f"multi-turn / single-turn tokens/s: {ratio:.3f}   (env latency {args.env_s} s per step; {machine})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": machine, "rows": rows, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
