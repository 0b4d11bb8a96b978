"""What a multi-turn continuation costs on this machine: the `extend` program by rows x width, against a decode
step of the full batch (the baseline, measured in the same run), on the model of `multiturn.py --model small`.

The table says where an extend's time goes: a fixed part (every weight read once, as a decode step does) and a
part per computed token (padding included: a padded row or column costs what a real one does). It is what the
extend buckets are sized from (`inference/layout.py`: widths from 4, rows in rungs of 1, 2, 3, 4, 6, 8, ...).

    python benchmarks/extend_cost.py [--model small|tiny] [--reps 20]

Writes benchmarks/results/extend_cost_<model>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine  # noqa: E402
from asyncrl.models import Model, preset  # noqa: E402
from benchmarks.machine import machine as host_machine  # noqa: E402


def median_ms(fn, reps: int) -> float:
    fn()
    fn()  # compiled and warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=["tiny", "small"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/extend_cost_<model>.json")
    args = ap.parse_args()
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", f"extend_cost_{args.model}.json")

    cfg = preset("tiny")
    if args.model == "small":  # as in multiturn.py
        cfg = dataclasses.replace(cfg, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                                  num_kv_heads=4, head_dim=64)
    model = Model(cfg)
    params = model.init_params(jax.random.PRNGKey(0))
    icfg = InferenceConfig(group_size=4, max_decode_batch_size=32, max_prefill_prompts=8, temperature=1.0,
                           params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16, max_seq_len=192,
                           max_turns=3, max_new_tokens=None, max_parked_rows=64)
    engine = Engine(model, params, icfg, None, eos_id=-1, seed=0)  # no EOS: rows never stop in the baseline
    sched, store = engine.scheduler, engine.store
    sched.state, store.kv = engine.programs.new_state(), engine.parking.new_store()

    # Baseline: one decode step of the full batch (32 live rows), in a call of its own as the engine makes it.
    prefill = engine.prefill([[1, 2, 3, 4, 5]] * engine.P)
    for i in range(engine.B):
        sched.state, _ = engine.layout.run(engine.programs.decode, np.int32(i % engine.P), np.int32(i), np.int32(0),
                                           np.uint32(i), np.int32(0), np.int32(0), np.bool_(False),
                                           np.int32(-1), np.zeros((engine.F,), np.int32), np.int32(0),
                                           device=(engine.params, sched.state, prefill, store.kv))

    def decode_step() -> None:
        sched.state, row = engine.layout.run(engine.programs.decode, np.int32(-1), np.int32(-1), np.int32(0),
                                             np.uint32(0), np.int32(0), np.int32(1), np.bool_(False),
                                             np.int32(-1), np.zeros((engine.F,), np.int32), np.int32(0),
                                             device=(engine.params, sched.state, prefill, store.kv))
        jax.device_get(row)

    decode_ms = median_ms(decode_step, args.reps)
    rows_out = []
    for rows in (1, 2, 4, 6, 8):
        for width in (4, 8, 16):
            feeds = [np.ones((width + 1,), np.int32)] * rows  # + the last token, passed beside the padded feed

            def extend() -> None:
                jax.block_until_ready(store.extend(engine.params, 0, list(range(rows)), feeds).kv)

            rows_out.append({"rows": rows, "width": width, "tokens": rows * width, "ms": median_ms(extend, args.reps)})
    # Least squares: ms = fixed + per_token x tokens.
    a = np.array([[1.0, r["tokens"]] for r in rows_out])
    fixed, per_token = np.linalg.lstsq(a, np.array([r["ms"] for r in rows_out]), rcond=None)[0]
    machine = host_machine()
    print(f"decode step, {engine.B} rows (baseline): {decode_ms:.1f} ms, {decode_ms / engine.B:.2f} ms a row")
    print(f"{'rows':>5}{'width':>6}{'tokens':>7}{'ms':>8}{'ms/token':>9}{'x decode':>9}")
    for r in rows_out:
        print(f"{r['rows']:5d}{r['width']:6d}{r['tokens']:7d}{r['ms']:8.1f}{r['ms'] / r['tokens']:9.2f}"
              f"{r['ms'] / decode_ms:9.2f}")
    print(f"fit: extend ms = {fixed:.1f} + {per_token:.2f} x computed tokens   ({machine})")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": machine, "decode_step_ms": decode_ms, "extend": rows_out,
                   "fit": {"fixed_ms": fixed, "per_token_ms": per_token}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
