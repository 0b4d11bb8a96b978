"""LoRA at inference: merge on receipt (W + alpha/r A B once per weight sync, then plain decode) against unmerged
adapters in every decode step (x W + alpha/r (x A) B), measured on this CPU with the real engine, and the weight
sync's bytes for the TPU presets.

CPU: the inference engine decodes the same prompts greedily for exactly N new tokens (EOS outside the vocabulary)
with (a) the merged weights and (b) the base with adapters attached (`lora.attach`; the engine's CPU layout
transposes the base and keeps the small adapters as they are). Each side runs `--repeats` times, alternating, after
a warm-up with the same shapes; the best run counts. The per-sync cost of (a) is the jitted merge (best of 5) plus
the engine's re-layout, which (b) pays too (`Engine.set_params`, best of 3 each).

Sync bytes: for every TPU preset with a Qwen3 or Llama model, the bytes a full fine-tune moves per sync (the params
in inference.params_dtype) against LoRA's (rank 32 on every projection, the adapters in the same dtype).

With `--aot FILE` (the JSON rows of `launch.py aot --config-name v5p8_qwen3_8b_lora --out FILE`), the compiled
TPU figures of `decode`, `decode_lora_unmerged` and `lora_merge` are added to the table.

    PYTHONPATH=. .venv/bin/python benchmarks/lora_inference.py [--model smollm2|tiny] [--batch 16]
        [--new-tokens 64] [--rank 32] [--repeats 3] [--aot FILE]

Writes benchmarks/results/lora_inference.json. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.models import Model, from_pretrained, lora, preset
from asyncrl.rollout import Prompt
from benchmarks.machine import machine

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(name: str):
    if name == "tiny":
        model = Model(preset("tiny"))
        return model, model.init_params(jax.random.PRNGKey(0), jnp.float32)
    from asyncrl.models.sources import convert_smollm2

    return from_pretrained(convert_smollm2(), dtype=jnp.float32)


def trained_adapters(model: Model, rank: int, seed: int = 1):
    """Adapters with B off its zero init, as after training (B = 0 would skip nothing in the unmerged path either)."""
    ad = lora.init(model.cfg, rank, tuple(lora.TARGETS), jax.random.key(seed))
    return {f: {"a": p["a"], "b": 0.01 * jax.random.normal(jax.random.key(seed + 7), p["b"].shape)}
            for f, p in ad.items()}


def engine(model: Model, params, batch: int, new_tokens: int) -> Engine:
    cfg = InferenceConfig(group_size=1, max_decode_batch_size=batch, max_prefill_prompts=batch,
                          max_seq_len=-(-(40 + new_tokens + 1) // 8) * 8, max_new_tokens=new_tokens, temperature=0.0,
                          params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16)
    return Engine(model, params, cfg, None, eos_id=model.cfg.vocab_size, seed=0)


def decode_tok_s(eng: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    reqs = [Request(Prompt(i), p) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    out = eng.generate(reqs, drain=True)
    wall = time.perf_counter() - t
    n = sum(int((~c.forced).sum()) for r in out for c in r.completions)
    if n != new_tokens * len(prompts):
        raise RuntimeError(f"expected {new_tokens} tokens per row, got {n} in all")
    return n / wall


def best_s(f, repeats: int) -> float:
    f()  # compile / warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t)
    return min(times)


def sync_bytes_table(rank: int) -> list[dict]:
    from asyncrl.config.loader import load_config
    from asyncrl.models.sources import model_config

    rows = []
    for path in sorted((HERE.parent / "configs").glob("v*_*.yaml")):
        cfg = load_config(path.stem)
        mcfg = model_config(cfg.model)
        item = jnp.dtype(cfg.inference.params_dtype).itemsize
        full = mcfg.num_params() * item
        adapters = lora.count(mcfg, rank, tuple(lora.TARGETS)) * item
        b_alone = lora.count(mcfg, rank, tuple(lora.TARGETS), ("b",)) * item  # train.lora.freeze_a
        rows.append({"preset": path.stem, "model_params": mcfg.num_params(), "full_sync_bytes": full,
                     "lora_sync_bytes": adapters, "ratio": full / adapters,
                     "lora_freeze_a_sync_bytes": b_alone, "ratio_freeze_a": full / b_alone})
    return rows


def print_sync_bytes(rows: list[dict]) -> None:
    print("\nweight sync bytes after the first, rank 32 on every projection:")
    print(f"{'preset':<24} {'full':>10} {'LoRA':>10} {'ratio':>7} {'A frozen':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['preset']:<24} {r['full_sync_bytes'] / 1e9:>8.2f}GB {r['lora_sync_bytes'] / 1e6:>8.1f}MB "
              f"{r['ratio']:>7.1f} {r['lora_freeze_a_sync_bytes'] / 1e6:>8.1f}MB {r['ratio_freeze_a']:>7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--aot", default=None, help="JSON rows from `launch.py aot ... --out FILE` of a LoRA preset")
    ap.add_argument("--out", default=str(RESULTS / "lora_inference.json"))
    ap.add_argument("--sync-bytes-only", action="store_true",
                    help="recompute the sync-bytes table (arithmetic over the presets) into the existing --out file")
    args = ap.parse_args()
    if args.sync_bytes_only:
        with open(args.out) as f:
            result = json.load(f)
        result["sync_bytes"] = sync_bytes_table(args.rank)
        print_sync_bytes(result["sync_bytes"])
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    info = machine()
    log(f"machine: {info}")
    model, params = load(args.model)
    ad = trained_adapters(model, args.rank)
    scale = 2.0  # alpha / r: its value does not change the work
    merge = jax.jit(lambda b, a: lora.merge(b, a, scale))
    merged = merge(params, ad)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.cfg.vocab_size - 1, size=int(rng.integers(16, 40))).tolist()
               for _ in range(args.batch)]
    engines = {"merged": engine(model, merged, args.batch, args.new_tokens),
               "unmerged": engine(model, lora.attach(params, ad, scale), args.batch, args.new_tokens)}
    for name, eng in engines.items():
        log(f"warm-up: {name}")
        decode_tok_s(eng, prompts, args.new_tokens)
    runs: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(args.repeats):
        for name, eng in engines.items():
            runs[name].append(decode_tok_s(eng, prompts, args.new_tokens))
            log(f"  run {i + 1}: {name} {runs[name][-1]:.1f} tok/s")
    merge_s = best_s(lambda: merge(params, ad), 5)
    relayout = {"merged": best_s(lambda: engines["merged"].set_params(merged, 1) or engines["merged"].params, 3),
                "unmerged": best_s(lambda: engines["unmerged"].set_params(lora.attach(params, ad, scale), 1)
                                   or engines["unmerged"].params, 3)}
    cpu = {name: {"decode_tok_s": max(r), "all_tok_s": r,
                  "sync_s": (merge_s if name == "merged" else 0.0) + relayout[name],
                  "merge_s": merge_s if name == "merged" else 0.0, "relayout_s": relayout[name]}
           for name, r in runs.items()}
    result = {"machine": info, "model": args.model, "batch": args.batch, "new_tokens": args.new_tokens,
              "rank": args.rank, "cpu": cpu, "unmerged_over_merged_decode": cpu["unmerged"]["decode_tok_s"] /
              cpu["merged"]["decode_tok_s"], "sync_bytes": sync_bytes_table(args.rank),
              "load_avg_1m_at_end": os.getloadavg()[0]}
    if args.aot:
        with open(args.aot) as f:
            aot = {r["program"]: r for r in json.load(f)}
        result["aot"] = {k: {f: aot[k].get(f) for f in ("topology", "chips", "peak_bytes_per_chip", "flops",
                                                         "hbm_bytes_accessed", "roofline_s", "fits")}
                         for k in ("decode", "decode_lora_unmerged", "lora_merge") if k in aot}

    print(f"\nLoRA at inference, {args.model} fp32, batch {args.batch}, {args.new_tokens} new tokens, rank {args.rank} "
          f"on every projection; {info['cpu']} ({info['cores']} cores, AVX-512 {info['avx512']}), load "
          f"{info['load_1m_at_start']:.2f} at start, {result['load_avg_1m_at_end']:.2f} at end")
    print(f"{'inference':<10} {'decode tok/s':>13} {'per sync s':>11} {'(merge s)':>10} {'(re-layout s)':>14}")
    for name, r in cpu.items():
        print(f"{name:<10} {r['decode_tok_s']:>13.1f} {r['sync_s']:>11.3f} {r['merge_s']:>10.3f} "
              f"{r['relayout_s']:>14.3f}")
    print(f"unmerged / merged decode: {result['unmerged_over_merged_decode']:.3f}")
    if "aot" in result:
        print("\nTPU (launch.py aot):")
        print(f"{'program':<22} {'topology':<10} {'roofline ms':>12} {'HBM bytes':>12} {'FLOPs':>12} {'peak GiB':>9}")
        for k, r in result["aot"].items():
            print(f"{k:<22} {r['topology']:<10} {1e3 * r['roofline_s']:>12.3f} {r['hbm_bytes_accessed']:>12.4g} "
                  f"{r['flops']:>12.4g} {r['peak_bytes_per_chip'] / 2**30:>9.2f}")
    print_sync_bytes(result["sync_bytes"])
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
