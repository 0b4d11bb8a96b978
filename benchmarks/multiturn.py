"""Multi-turn decode throughput against single-turn, at equal generated tokens, with a slow environment.

The engine alone (no Ray, no trainer): the tiny model fed a stream of prompts the way an inference worker feeds it;
each sample an episode of TURNS model turns separated by an environment step that sleeps ENV_S (a tool, a game)
before it answers with a short observation; against the same stream decoded in one turn of TURNS x the per-turn
budget (the baseline, same generated tokens per episode, no environment). Reported for both, over the steady
phase: generated tokens/s (sampled tokens only: a decode step that feeds an observation token generates none), and
decode-slot occupancy, as the share of the decode batch's row-steps that held a live row (`EngineStats.slot_steps`)
and as the same share of the wall time (prefills, extends and any wait count as idle), and of that time the share
spent sampling rather than feeding observations; and the share of the wall time the engine ran a model program for
its rows (decode, extend or prefill), the rest being parks and host work between calls.

    python benchmarks/multiturn.py [--env-s 0.5] [--seconds 30] [--pairs 5] [--turns 3] [--tokens-per-turn 32] \\
        [--parked 512]

Writes benchmarks/results/multiturn_<model>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.models import Model, preset  # noqa: E402
from asyncrl.rollout import Prompt, StepResult  # noqa: E402
from benchmarks.machine import machine as host_machine  # noqa: E402


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


def run(engine: Engine, make_requests: Callable[[int, int], list[Request]], seconds: float,
        warm_s: float) -> dict[str, float]:
    """Feed prompts the way an inference worker does (a chunk of `max_prefill_prompts` whenever the last chunk's
    rows are all inserted, `generate(drain=False)`) for `seconds`, then drain. "Steady" figures are over the
    feeding phase after `warm_s` (the pipeline full: episodes waiting on their environments, parked), while a
    prompt is always waiting for a free slot, as in a run whose feeder never runs dry; the drain, where the last
    episodes wait on their environments with nothing to replace them, is only in the whole-run figures."""
    s0 = dict(vars(engine.stats))
    t0 = time.perf_counter()
    out, fed, marks = [], 0, []
    while time.perf_counter() - t0 < seconds:
        out += engine.generate(make_requests(fed, engine.P), drain=False)
        fed += engine.P
        marks.append((time.perf_counter() - t0, dict(vars(engine.stats))))
    w0 = next((t, st) for t, st in marks if t >= warm_s)
    w1 = marks[-1]
    out += engine.generate([], drain=True)
    wall = time.perf_counter() - t0
    s, B = vars(engine.stats), engine.B
    fed_all = engine.stats.fed_tokens - s0["fed_tokens"]
    generated = s["slot_steps"] - s0["slot_steps"] - fed_all  # sampled tokens
    span = max(w1[0] - w0[0], 1e-9)
    steady = {k: w1[1].get(k, 0) - w0[1].get(k, 0) for k in (
        "slot_steps", "slot_time", "decode_steps", "decode_time", "extend_time", "prefill_time", "parked_full",
        "calls", "extend_calls", "extend_rows", "park_time", "fed_tokens")}
    sampled = steady["slot_steps"] - steady["fed_tokens"]  # row-steps that sampled a token
    comps = [c for r in out for c in r.completions]
    return {"steady_s": span, "steady_tokens_per_s": sampled / span,
            "steady_slots_busy_steps": steady["slot_steps"] / max(1, steady["decode_steps"] * B),
            "steady_slots_busy_time": steady["slot_time"] / (B * span),
            "steady_slots_sampling_time": steady["slot_time"] / (B * span) * sampled / max(1, steady["slot_steps"]),
            "steady_fed_share": steady["fed_tokens"] / max(1, steady["slot_steps"]),
            "steady_decode_share": steady["decode_time"] / span, "steady_extend_share": steady["extend_time"] / span,
            "steady_model_share": (steady["decode_time"] + steady["extend_time"] + steady["prefill_time"]) / span,
            "steady_prefill_share": steady["prefill_time"] / span, "steady_re_prefills": float(steady["parked_full"]),
            "steady_park_share": steady["park_time"] / span, "steady_decode_calls_per_s": steady["calls"] / span,
            "steady_steps_per_call": steady["decode_steps"] / max(1, steady["calls"]),
            "steady_extend_calls_per_s": steady["extend_calls"] / span,
            "steady_extend_rows_per_call": steady["extend_rows"] / max(1, steady["extend_calls"]),
            "wall_s": wall, "generated_tokens": float(generated),
            "tokens_per_s": generated / wall,
            "episodes": float(len(comps)), "turns_mean": float(np.mean([c.n_turns for c in comps])),
            "env_s": s["env_time"] - s0["env_time"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-s", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--pairs", type=int, default=5, help="multi-turn and single-turn runs, alternating (ABBA)")
    ap.add_argument("--warm-s", type=float, default=8.0)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--parked", type=int, default=512)
    ap.add_argument("--extend-wait-s", type=float, default=InferenceConfig.extend_wait_s)
    ap.add_argument("--decode-feed-tokens", type=int, default=InferenceConfig.decode_feed_tokens,
                    help="continuations of at most this many tokens are fed by decode steps; 0: all through extend")
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"],
                    help="tiny: the 2-layer test model (per-call overhead dominates); small: 8 layers x 512 wide, "
                         "where a decode step costs what it costs a real model relative to the host's per-call work")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/multiturn_<model>.json, with "
                                                "_<N>tok before .json when --tokens-per-turn is not 32")
    args = ap.parse_args()
    tag = "" if args.tokens_per_turn == 32 else f"_{args.tokens_per_turn}tok"
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", f"multiturn_{args.model}{tag}.json")

    cfg = preset("tiny")
    if args.model == "small":
        cfg = dataclasses.replace(cfg, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                                  num_kv_heads=4, head_dim=64)
    model = Model(cfg)
    params = model.init_params(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    obs = rng.integers(10, 90, size=4).tolist()
    base = dict(group_size=args.group, max_decode_batch_size=args.batch, max_prefill_prompts=8, temperature=1.0,
                params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16)
    per_turn = args.tokens_per_turn
    span = args.turns * (per_turn + 1 + len(obs) + 1) + 16
    seq = 64 * ((span + 63) // 64)
    # Multi-turn: TURNS turns of per_turn tokens (+ EOS slot), an observation between them. Single-turn: one turn of
    # the same total, so both generate the same tokens per episode.
    multi_cfg = InferenceConfig(**base, max_seq_len=seq, max_turns=args.turns, max_new_tokens=per_turn,
                                max_parked_rows=args.parked, extend_wait_s=args.extend_wait_s,
                                decode_feed_tokens=args.decode_feed_tokens)
    single_cfg = InferenceConfig(**base, max_seq_len=seq, max_turns=1, max_new_tokens=args.turns * (per_turn + 1) - 1)
    # A random model samples this EOS about 1 token in 128: turns end mostly at their budget (max_new_tokens).
    eos = model.cfg.vocab_size - 1
    multi = Engine(model, params, multi_cfg, None, eos_id=eos, seed=0)
    single = Engine(model, params, single_cfg, None, eos_id=eos, seed=0)

    def requests(with_env: bool):
        def make(start: int, n: int) -> list[Request]:
            out = []
            for i in range(start, start + n):
                p = np.random.default_rng(i).integers(10, 90, size=6 + i % 6).tolist()
                envs = [SleepyEnv(p, obs, args.env_s) for _ in range(args.group)] if with_env else None
                out.append(Request(Prompt(i, None, args.group), p, envs))
            return out
        return make

    # Warm-up: every program compiled (prefill and extend buckets, both decode programs), then measured.
    run(multi, requests(True), 2.0, 0.0)
    run(single, requests(False), 2.0, 0.0)
    # Every extend rung, at this benchmark's continuation width: a few seconds of warm-up meet only some of them,
    # and a compile inside the measured phase would count as extend time.
    feed = np.asarray([1] + obs, np.int32)
    t0 = time.perf_counter()
    for n in sorted({multi.extend_rows(n) for n in range(1, multi.P + 1)}):
        jax.block_until_ready(multi.store.extend(multi.params, 0, list(range(n)), [feed] * n).kv)
    print(f"extend programs compiled in {time.perf_counter() - t0:.1f} s")
    # Pairs, in ABBA order: this machine's speed drifts by 10-15% from minute to minute (other tenants), and a ratio
    # taken from one multi-turn run and one single-turn run a minute later carries that drift.
    pairs = []
    for i in range(args.pairs):
        order = ("multi_turn", "single_turn") if i % 2 == 0 else ("single_turn", "multi_turn")
        pair = {}
        for name in order:
            pair[name] = run(multi, requests(True), args.seconds, args.warm_s) if name == "multi_turn" \
                else run(single, requests(False), args.seconds, args.warm_s)
        pair["ratio_steady"] = pair["multi_turn"]["steady_tokens_per_s"] / pair["single_turn"]["steady_tokens_per_s"]
        pair["ratio_all"] = pair["multi_turn"]["tokens_per_s"] / pair["single_turn"]["tokens_per_s"]
        pairs.append(pair)
    ratios = [p["ratio_steady"] for p in pairs]
    ratio = float(np.median(ratios))
    ratio_all = float(np.median([p["ratio_all"] for p in pairs]))
    rows = min(pairs, key=lambda p: abs(p["ratio_steady"] - ratio))  # the median pair (the lower middle if even)
    machine = host_machine()
    machine["devices"] = str(jax.devices()[0])
    print(f"{'':16}{'steady s':>9}{'tok/s':>8}{'busy(steps)':>12}{'busy(time)':>11}{'decode':>8}{'extend':>8}"
          f"{'prefill':>8}{'model':>7}{'re-prefill':>11} |{'wall s':>8}{'episodes':>9}{'tokens':>8}{'tok/s':>8}"
          f"{'turns':>6}")
    for i, pair in enumerate(pairs):
        for name in ("multi_turn", "single_turn"):
            r = pair[name]
            print(f"{i} {name:14}{r['steady_s']:9.2f}{r['steady_tokens_per_s']:8.0f}"
                  f"{r['steady_slots_busy_steps']:12.3f}"
                  f"{r['steady_slots_busy_time']:11.3f}{r['steady_decode_share']:8.3f}{r['steady_extend_share']:8.3f}"
                  f"{r['steady_prefill_share']:8.3f}{r['steady_model_share']:7.3f}{r['steady_re_prefills']:11.0f} |"
                  f"{r['wall_s']:8.2f}"
                  f"{r['episodes']:9.0f}{r['generated_tokens']:8.0f}{r['tokens_per_s']:8.0f}{r['turns_mean']:6.2f}")
        r = pair["multi_turn"]
        print(f"{i} multi_turn     sampling (time) {r['steady_slots_sampling_time']:.3f}, row-steps feeding "
              f"observations {r['steady_fed_share']:.3f}, decode calls/s {r['steady_decode_calls_per_s']:.1f}, "
              f"steps/call "
              f"{r['steady_steps_per_call']:.2f}, park share {r['steady_park_share']:.3f}, extend calls/s "
              f"{r['steady_extend_calls_per_s']:.1f} x {r['steady_extend_rows_per_call']:.1f} rows; "
              f"multi / single steady {pair['ratio_steady']:.3f}")
    print(f"multi-turn / single-turn tokens/s, median of {len(pairs)} pairs: steady {ratio:.3f} "
          f"({' / '.join(f'{x:.3f}' for x in ratios)}), whole run with its tail {ratio_all:.3f}   "
          f"(env latency {args.env_s} s per step; {machine})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": machine, "rows": rows, "ratio_steady": ratio, "ratio_all": ratio_all,
                   "pairs": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
