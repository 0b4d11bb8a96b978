"""Decode throughput of the inference engine vs transformers `generate` (torch, CPU), its share of the
memory-bandwidth roofline, slot utilization of continuous vs static batching, where the decode time goes, and
the SPMD row substitution (shard_map vs naive) on 4 fake CPU devices.

Both sides decode the same prompts greedily for exactly N new tokens (ours: an EOS id outside the vocabulary,
so it is never sampled; transformers: min_new_tokens = max_new_tokens = N) and count N tokens per row. Ours is
timed after a warm-up call with the same shapes (compile excluded, reported separately); each side runs
`--repeats` times, alternating, and the best run counts. Bandwidth and matmul FLOP/s are measured in the same
run, since figures on a shared 2-core machine move from run to run: only ratios within one run mean much.

    PYTHONPATH=. python benchmarks/decode.py [--quick] [--models tiny smollm2] [--batches 1 16]
        [--dtypes float32 bfloat16] [--new-tokens 128] [--bf16-new-tokens 32] [--repeats 3] [--budget-s 90]
        [--skip-spmd] [--skip-profile]

Writes benchmarks/results/decode.json (--quick: decode_quick.json). Progress goes to stderr.
"""

from __future__ import annotations

import os

# The SPMD section needs 4 devices; the flag must be set before jax is imported. The single-device
# benchmarks run on device 0 and are unaffected (XLA:CPU devices share one thread pool).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.inference.replicas import ReplicaSet  # noqa: E402
from asyncrl.models import (  # noqa: E402
    Model,
    from_pretrained,
    params as params_lib,  # noqa: E402
    preset,
    save_pretrained,
)
from asyncrl.rollout import Prompt  # noqa: E402
from benchmarks.machine import describe, machine  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = {"tiny": "tiny", "smollm2": "SmolLM2-135M"}
PROMPT_LENS = (20, 33)  # prompt lengths drawn from [20, 33): mixed lengths, one 32-token prefill bucket
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[decode {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- machine figures ------------------------------------------------------------------------------------------


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """Bytes read + written per second by a numpy copy of `mib` MiB, on 1 thread and split over 2 threads."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch: page faults are not bandwidth

    def best(threads: int) -> float:
        parts = list(zip(np.array_split(dst, threads), np.array_split(src, threads)))
        times = []
        for _ in range(repeats):
            workers = [threading.Thread(target=np.copyto, args=p) for p in parts]  # copyto releases the GIL
            t = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            times.append(time.perf_counter() - t)
        return 2 * src.nbytes / min(times)

    return {"copy_1thread_Bps": best(1), "copy_2threads_Bps": best(2)}


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


# ---- models and prompts ---------------------------------------------------------------------------------------


@dataclass
class Loaded:
    name: str
    model: Model
    params: Any
    hf_folder: str  # fp32 HF twin for transformers


def load(name: str, dtype: str, tmp: str) -> Loaded:
    if name == "tiny":
        model = Model(preset("tiny"))
        params = model.init_params(jax.random.PRNGKey(0), jnp.float32)
        folder = os.path.join(tmp, "tiny_hf")
        if not os.path.isdir(folder):
            save_pretrained(model, params, folder)
        return Loaded(name, model, params_lib.cast(params, jnp.dtype(dtype)), folder)
    if name == "smollm2":
        from asyncrl.models.sources import convert_smollm2

        folder = convert_smollm2()
        model, params = from_pretrained(folder, dtype=jnp.dtype(dtype))
        return Loaded(name, model, params, folder)
    raise SystemExit(f"--models: unknown model {name!r}; known: {sorted(MODELS)}")


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab - 1, size=int(rng.integers(*PROMPT_LENS))).tolist() for _ in range(batch)]


def seq_len_for(new_tokens: int) -> int:
    return -(-(PROMPT_LENS[1] + new_tokens + 1) // 8) * 8  # prompt + N sampled + the forced EOS slot


def engine_for(m: Loaded, dtype: str, batch: int, new_tokens: int, temperature: float = 0.0,
               eos_id: int | None = None, seed: int = 0, prefill: int | None = None) -> Engine:
    cfg = InferenceConfig(
        group_size=1, max_decode_batch_size=batch, max_prefill_prompts=prefill or batch,
        max_seq_len=seq_len_for(new_tokens), max_new_tokens=new_tokens, temperature=temperature,
        params_dtype=dtype, kv_cache_dtype=dtype, min_prefill_bucket=16,
    )
    # Default EOS = vocab_size: argmax/categorical never return it, so every row decodes exactly N tokens.
    eos = m.model.cfg.vocab_size if eos_id is None else eos_id
    return Engine(m.model, m.params, cfg, None, eos_id=eos, seed=seed)


# ---- ours vs transformers -------------------------------------------------------------------------------------

_COMPILE_S = [0.0]  # trace + lower + XLA compile seconds, summed by a jax.monitoring listener


def _on_duration(event: str, seconds: float, **_: Any) -> None:
    if event.startswith("/jax/core/compile/"):
        _COMPILE_S[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def time_ours(eng: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    reqs = [Request(Prompt(i), p) for i, p in enumerate(prompts)]
    s = eng.stats
    before = (s.decode_steps, s.calls)
    t = time.perf_counter()
    out = eng.generate(reqs, drain=True)
    wall = time.perf_counter() - t
    comps = [c for r in out for c in r.completions]
    sampled = [int((~c.forced).sum()) for c in comps]
    eos_sampled = sum(int(((c.tokens == eng.eos_id) & ~c.forced).sum()) for c in comps)
    if eos_sampled or any(n != new_tokens for n in sampled):
        raise RuntimeError(f"expected {new_tokens} sampled tokens per row and no EOS; got {sampled}, eos={eos_sampled}")
    return {"wall_s": wall, "tokens": sum(sampled), "tok_s": sum(sampled) / wall,
            "decode_steps": s.decode_steps - before[0], "calls": s.calls - before[1]}


class HF:
    """transformers `generate` on the same prompts, left-padded, greedy, exactly N new tokens."""

    def __init__(self, folder: str, dtype: str, prompts: list[list[int]]):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        self.inputs = {"input_ids": ids, "attention_mask": mask}
        self.width = width

    def pick_threads(self, new_tokens: int = 8) -> int:
        """Give torch its better thread count (2 or 1): on a loaded 2-core machine OpenMP's 2 threads can lose
        more to barrier waits than they gain, which would flatter our ratio."""
        best = None
        for threads in (self.torch.get_num_threads(), 1):
            self.torch.set_num_threads(threads)
            self.generate(2)
            wall = min(self.generate(new_tokens)["wall_s"] for _ in range(2))
            if best is None or wall < best[1]:
                best = (threads, wall)
        self.torch.set_num_threads(best[0])
        return best[0]

    def generate(self, new_tokens: int) -> dict[str, Any]:
        with self.torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(**self.inputs, do_sample=False, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=0)
            wall = time.perf_counter() - t
        n = (out.shape[1] - self.width) * out.shape[0]
        if out.shape[1] - self.width != new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - self.width} tokens, expected {new_tokens}")
        return {"wall_s": wall, "tokens": n, "tok_s": n / wall}


def roofline(m: Loaded, dtype: str, batch: int, prompts: list[list[int]], new_tokens: int, bw: float,
             flops: float) -> dict[str, Any]:
    """Tokens/s if a decode step only had to move its bytes at `bw` (or only do its matmul FLOPs at `flops`).

    Bytes per step = every parameter once (the tied embedding is read as the LM head) + the KV cache of the
    positions each row attends to, averaged over the N steps. The engine reads its whole max_seq_len cache
    every step; that figure is reported too but the roofline uses what an ideal kernel must read."""
    c = m.model.cfg
    itemsize = jnp.dtype(dtype).itemsize
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(m.params))
    mean_ctx = float(np.mean([len(p) for p in prompts])) + new_tokens / 2
    kv_ideal = batch * mean_ctx * c.kv_bytes_per_token(itemsize)
    kv_engine = batch * seq_len_for(new_tokens) * c.kv_bytes_per_token(itemsize)
    step_flops = 2 * batch * c.num_params() + 4 * batch * c.num_layers * c.num_heads * c.head_dim * mean_ctx
    return {
        "param_bytes": param_bytes, "kv_bytes_ideal_per_step": kv_ideal, "kv_bytes_engine_reads_per_step": kv_engine,
        "bytes_per_step": param_bytes + kv_ideal, "bw_roof_tok_s": batch * bw / (param_bytes + kv_ideal),
        "flops_per_step": step_flops, "flop_roof_tok_s": batch * flops / step_flops,
    }


def bench_config(m: Loaded, dtype: str, batch: int, new_tokens: int, repeats: int, budget_s: float, bw: float,
                 flops: float) -> tuple[dict[str, Any], Engine, list[list[int]]]:
    prompts = make_prompts(batch, m.model.cfg.vocab_size)
    eng = engine_for(m, dtype, batch, new_tokens)
    t, compile0 = time.perf_counter(), _COMPILE_S[0]
    warm = time_ours(eng, prompts, new_tokens)
    warm_s = time.perf_counter() - t
    compile_s = _COMPILE_S[0] - compile0
    hf = HF(m.hf_folder, dtype, prompts)
    threads0 = hf.torch.get_num_threads()
    torch_threads = hf.pick_threads(min(8, new_tokens))
    # Slow configs get fewer runs so the default benchmark stays within ~15 minutes on 2 cores.
    repeats = int(min(repeats, max(1, budget_s // max(warm_s, 1e-3))))
    ours_runs, hf_runs = [], []
    for _ in range(repeats):  # alternate so load from other processes hits both sides alike
        ours_runs.append(time_ours(eng, prompts, new_tokens))
        hf_runs.append(hf.generate(new_tokens))
    ours = max(ours_runs, key=lambda r: r["tok_s"])
    theirs = max(hf_runs, key=lambda r: r["tok_s"])
    ours["compile_s"] = compile_s  # measured by JAX itself: (warm-up - timed run) would carry the load's noise
    ours["ms_per_step"] = 1000 * ours["wall_s"] / ours["decode_steps"]
    ours["all_tok_s"] = [r["tok_s"] for r in ours_runs]
    theirs["all_tok_s"] = [r["tok_s"] for r in hf_runs]
    theirs["ms_per_token_step"] = 1000 * theirs["wall_s"] / new_tokens
    theirs["torch_threads"] = torch_threads
    hf.torch.set_num_threads(threads0)
    roof = roofline(m, dtype, batch, prompts, new_tokens, bw, flops)
    row = {
        "model": MODELS[m.name], "dtype": dtype, "batch": batch, "new_tokens": new_tokens,
        "prompt_lens": [len(p) for p in prompts], "max_seq_len": seq_len_for(new_tokens),
        "ours": ours, "transformers": theirs, "ratio": ours["tok_s"] / theirs["tok_s"], "roofline": roof,
        "share_of_bw_roof": ours["tok_s"] / roof["bw_roof_tok_s"],
        "share_of_flop_roof": ours["tok_s"] / roof["flop_roof_tok_s"],
        "warmup_tok_s": warm["tok_s"], "repeats": repeats,
    }
    del hf
    return row, eng, prompts


# ---- slot utilization -------------------------------------------------------------------------------------------


def slot_utilization(m: Loaded, sequences: int, batch: int, max_new: int, eos_id: int) -> dict[str, Any]:
    """Continuous batching (the engine) vs static batching on the same long-tailed completion lengths.

    Lengths come from sampling at temperature 1 from the random tiny model, where EOS has ~1/vocab chance per
    step: roughly geometric, i.e. long-tailed, and capped at max_new (+ the forced EOS). Useful tokens are the
    completion tokens (EOS included: each one occupied a slot for a step). Static batching takes the same
    lengths in arrival order in batches of `batch` and pays max(length) steps per batch."""
    eng = engine_for(m, "float32", batch, max_new, temperature=1.0, eos_id=eos_id, seed=1)
    prompts = make_prompts(sequences, m.model.cfg.vocab_size, seed=1)
    reqs = [Request(Prompt(i), p) for i, p in enumerate(prompts)]
    eng.generate(reqs[:batch], drain=True)  # compile
    steps0, calls0 = eng.stats.decode_steps, eng.stats.calls
    t = time.perf_counter()
    out = sorted(eng.generate(reqs, drain=True), key=lambda r: r.prompt.position)  # position = arrival order
    wall = time.perf_counter() - t
    lengths = np.asarray([len(r.completions[0].tokens) for r in out])
    steps = eng.stats.decode_steps - steps0
    static_steps = int(sum(lengths[i:i + batch].max() for i in range(0, len(lengths), batch)))
    useful = int(lengths.sum())
    return {
        "sequences": sequences, "batch_slots": batch, "max_new_tokens": max_new,
        "length_stats": {"mean": float(lengths.mean()), "p50": float(np.median(lengths)),
                         "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                         "min": int(lengths.min())},
        "useful_tokens": useful, "continuous_steps": steps, "static_steps": static_steps,
        "continuous_util": useful / (steps * batch), "static_util": useful / (static_steps * batch),
        "continuous_calls": eng.stats.calls - calls0, "continuous_wall_s": wall,
        "lengths": lengths.tolist(),
    }


# ---- where the time goes ----------------------------------------------------------------------------------------


def _best_ms(f, *args, repeats: int = 5) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


_HLO_NAME = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)?$")  # XLA instruction names: "ynn_fusion.3", "copy.28"
_CONTAINERS = ("while", "conditional", "call")


def _category(name: str) -> str | None:
    """Bucket an XLA:CPU thunk name. None for host-side events and for loops, whose children hold their time."""
    if not _HLO_NAME.match(name) or name.startswith(_CONTAINERS):
        return None
    if "ynn" in name or "dot" in name or "onednn" in name or "gemm" in name or "custom-call" in name:
        return "matmuls"
    if name.startswith("dynamic-slice"):
        return "dynamic-slice copies (per-layer weight/KV slices of the stacked scan)"
    if "scatter" in name or "dynamic-update-slice" in name:
        return "KV write / row updates (scatter, dynamic-update-slice)"
    if "transpose" in name or name.startswith("copy"):
        return "copies / relayouts (transpose, copy)"
    if "broadcast" in name:
        return "buffer init (broadcast)"
    if "reduce" in name:
        return "reductions (softmax, norms, argmax)"
    return "other elementwise fusions"


def trace_split(run) -> tuple[float, dict[str, float], dict[str, float]]:
    """Run `run()` under the JAX profiler. Returns (wall ms, leaf XLA:CPU thunk ms by category, by op name)."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t = time.perf_counter()
        run()
        wall = 1000 * (time.perf_counter() - t)
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        events = json.load(gzip.open(files[-1]))["traceEvents"]
    by_cat: dict[str, float] = collections.Counter()
    by_op: dict[str, float] = collections.Counter()
    for e in events:
        cat = _category(e["name"]) if e.get("ph") == "X" else None
        if cat is not None:
            by_cat[cat] += e["dur"] / 1000
            by_op[e["name"]] += e["dur"] / 1000
    return wall, dict(by_cat), dict(collections.Counter(by_op).most_common(12))


def profile(m: Loaded, dtype: str, eng: Engine, prompts: list[list[int]], new_tokens: int,
            row: dict[str, Any]) -> dict[str, Any]:
    """Where one generate's time goes: compile, prefill, decode steps, and inside a step."""
    batch, S, c = len(prompts), eng.S, m.model.cfg
    prefill_ms = _best_ms(lambda: eng.prefill(prompts), repeats=3)
    ours = row["ours"]
    decode_ms = 1000 * ours["wall_s"] - prefill_ms  # one prefill per generate (max_prefill_prompts = batch)
    # The engine's forward alone (same shapes, donated cache) and the LM head alone, to separate the model from
    # the engine's per-step work (sampling, forcing, [B, S] bookkeeping, the while loop).
    kv = m.model.init_kv_cache(batch, S, jnp.dtype(dtype), per_layer=eng.cpu)  # the layout the engine decodes with
    kv = type(kv)(k=jax.tree.map(lambda a: a + 0, kv.k), v=jax.tree.map(lambda a: a + 0, kv.v),
                  length=jnp.full((batch,), S // 2, jnp.int32))  # distinct buffers
    fwd = jax.jit(lambda p, x, n, kv: m.model.apply(p, x, n, kv), donate_argnums=(3,))
    box = {"kv": kv}
    x, ones = jnp.ones((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32)

    def fwd_step():
        logits, box["kv"] = fwd(eng.params, x, ones, box["kv"])
        return logits

    fwd_ms = _best_ms(fwd_step)
    h = jnp.ones((batch, c.hidden_size), jnp.dtype(dtype))
    head_ms = _best_ms(jax.jit(m.model.lm_head), m.params, h)
    out = {
        "model": MODELS[m.name], "dtype": dtype, "batch": batch, "new_tokens": new_tokens, "max_seq_len": S,
        "generate_wall_ms": 1000 * ours["wall_s"], "compile_s": ours["compile_s"],
        "prefill_ms": prefill_ms, "decode_ms": decode_ms, "decode_steps": ours["decode_steps"],
        "calls": ours["calls"], "engine_ms_per_step": decode_ms / ours["decode_steps"],
        "forward_only_ms_per_step": fwd_ms, "lm_head_ms": head_ms,
        "transformers_ms_per_token_step": row["transformers"]["ms_per_token_step"],
        "bw_roof_ms_per_step": 1000 * row["roofline"]["bytes_per_step"] / BW["used_Bps"],
        "flop_roof_ms_per_step": 1000 * row["roofline"]["flops_per_step"] / BW["matmul_flops"],
    }
    try:
        steps0 = eng.stats.decode_steps
        reqs = [Request(Prompt(i), p) for i, p in enumerate(prompts)]
        wall, by_cat, by_op = trace_split(lambda: eng.generate(reqs, drain=True))
        n = eng.stats.decode_steps - steps0
        out["xla_trace"] = {
            "wall_ms_per_step": wall / n,
            "thunk_ms_per_step": {k: v / n for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_ops_ms_per_step": {k: v / n for k, v in by_op.items()},
            "note": "wall includes the prefill and the profiler's own overhead; leaf thunks only (loops excluded)",
        }
    except Exception as e:  # the profiler is a diagnostic: its absence must not lose the numbers above
        out["xla_trace"] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ---- SPMD row substitution --------------------------------------------------------------------------------------


def spmd_substitution(m: Loaded, batch: int, sequences: int, max_new: int, eos_id: int,
                      devices: Sequence[Any], end_to_end: bool = True, seq_len: int | None = None) -> dict[str, Any]:
    """ReplicaSet(replica_mode='spmd') on `devices`: shard_map substitution ('auto') vs XLA's gather-everything
    ('naive'). Reports a pure substitution (a fill call: no decode step runs) and, with `end_to_end`, a sampled
    run of `sequences` prompts (ms per call and per decode step)."""
    seq_len = seq_len or seq_len_for(max_new)
    out: dict[str, Any] = {"devices": len(devices), "batch": batch, "sequences": sequences, "max_new_tokens": max_new,
                           "max_seq_len": seq_len}
    prompts = make_prompts(sequences, m.model.cfg.vocab_size, seed=2)
    cfg = InferenceConfig(
        group_size=1, max_decode_batch_size=batch, max_prefill_prompts=batch, max_seq_len=seq_len,
        max_new_tokens=max_new, temperature=1.0, replica_mode="spmd", params_dtype="float32",
        kv_cache_dtype="float32", min_prefill_bucket=16,
    )
    for substitute in ("auto", "naive"):
        rs = ReplicaSet(m.model, m.params, cfg, None, devices=devices, eos_id=eos_id, seed=3, substitute=substitute)
        eng = rs.engines[0]
        # Pure substitution: n requests into an empty engine without draining are one prefill and n fill calls
        # (no decode step runs: each call only substitutes a prefilled row into a free one). The difference
        # between n = batch and n = 1 cancels the prefill and leaves batch - 1 substitutions.
        reqs = [Request(Prompt(i), p) for i, p in enumerate(prompts)]

        def fill_round(n: int) -> float:
            t = time.perf_counter()
            eng.generate(reqs[:n], drain=False)
            jax.block_until_ready(eng.scheduler.state)
            ms = 1000 * (time.perf_counter() - t)
            eng.generate([], drain=True)
            return ms

        fill_round(batch)  # compile
        full = min(fill_round(batch) for _ in range(2))
        one = min(fill_round(1) for _ in range(2))
        r = out[substitute] = {"fill_call_ms": (full - one) / (batch - 1), "prefill_and_fill_all_ms": full,
                               "prefill_and_fill_one_ms": one,
                               "kv_cache_bytes": m.model.cfg.kv_bytes_per_token(4) * batch * eng.S}
        log(f"  spmd {substitute}: substitution alone {r['fill_call_ms']:.2f} ms/call")
        if not end_to_end:
            continue
        rs.generate(reqs[:batch])  # compile the drain path
        s0, c0 = eng.stats.decode_steps, eng.stats.calls
        t = time.perf_counter()
        rs.generate(reqs)
        wall = time.perf_counter() - t
        steps, calls = eng.stats.decode_steps - s0, eng.stats.calls - c0
        r.update({"wall_s": wall, "decode_steps": steps, "calls": calls,
                  "ms_per_call": 1000 * wall / calls, "ms_per_decode_step": 1000 * wall / max(steps, 1)})
        log(f"  spmd {substitute}: sampled run {r['ms_per_call']:.2f} ms/call, {r['ms_per_decode_step']:.2f} ms/step")
    return out


# ---- report -----------------------------------------------------------------------------------------------------

BW: dict[str, float] = {}


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':<13}{'dtype':<9}{'B':>3}{'N':>4} {'ours tok/s':>11}{'HF tok/s':>10}{'ratio':>7}"
            f"{'ms/step':>9}{'BW roof':>9}{'%BW':>6}{'FLOP roof':>10}{'%FLOP':>7}{'compile s':>10}{'runs':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o, rf = r["ours"], r["roofline"]
        lines.append(
            f"{r['model']:<13}{r['dtype']:<9}{r['batch']:>3}{r['new_tokens']:>4} {o['tok_s']:>11.1f}"
            f"{r['transformers']['tok_s']:>10.1f}"
            f"{r['ratio']:>6.2f}x{o['ms_per_step']:>9.2f}{rf['bw_roof_tok_s']:>9.0f}"
            f"{100 * r['share_of_bw_roof']:>5.1f}%"
            f"{rf['flop_roof_tok_s']:>10.0f}{100 * r['share_of_flop_roof']:>6.1f}%{o['compile_s']:>10.1f}"
            f"{r['repeats']:>5}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, 32 new tokens")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=None, help="N new tokens per row (default 128; --quick 32)")
    ap.add_argument("--bf16-new-tokens", type=int, default=32,
                    help="N for SmolLM2 bf16 rows: XLA:CPU runs bf16 several times slower than fp32 (it upcasts the "
                         "weights every step), and 128 tokens there alone would take most of the 15-minute budget")
    ap.add_argument("--repeats", type=int, default=3, help="at most this many timed runs per side; the best counts")
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="repeats are cut to budget_s / (warm-up seconds), at least 1, to bound slow configs")
    ap.add_argument("--skip-spmd", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode[_quick].json)")
    args = ap.parse_args()
    models = args.models or (["tiny"] if args.quick else ["tiny", "smollm2"])
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    out_path = pathlib.Path(args.out) if args.out else RESULTS / ("decode_quick.json" if args.quick else "decode.json")

    host = machine()  # the CPU model, vector extensions, XLA flags and load: beside every figure
    log(f"machine: {describe(host)}")
    log("measuring copy bandwidth and matmul FLOP/s")
    BW.update(copy_bandwidth())
    BW["matmul_flops"] = matmul_flops()
    BW["used_Bps"] = max(BW["copy_1thread_Bps"], BW["copy_2threads_Bps"])
    log(f"  copy {BW['copy_1thread_Bps'] / 1e9:.1f} GB/s (1 thread), {BW['copy_2threads_Bps'] / 1e9:.1f} GB/s "
        f"(2 threads); matmul {BW['matmul_flops'] / 1e9:.0f} GFLOP/s")

    rows, prof = [], None
    profile_key = ("smollm2" if "smollm2" in models else models[0], "float32", max(args.batches))
    with tempfile.TemporaryDirectory() as tmp:
        loaded: dict[str, Loaded] = {}
        for name in models:
            for dtype in args.dtypes:
                m = load(name, dtype, tmp)
                if dtype == "float32":
                    loaded[name] = m
                slow = (name, dtype) == ("smollm2", "bfloat16")
                n_new = min(new_tokens, args.bf16_new_tokens) if slow else new_tokens
                for batch in args.batches:
                    log(f"{MODELS[name]} {dtype} batch {batch}: {n_new} new tokens")
                    row, eng, prompts = bench_config(m, dtype, batch, n_new, args.repeats, args.budget_s,
                                                     BW["used_Bps"], BW["matmul_flops"])
                    rows.append(row)
                    log(f"  ours {row['ours']['tok_s']:.1f} tok/s "
                        f"(runs {np.round(row['ours']['all_tok_s'], 1).tolist()}),"
                        f" transformers {row['transformers']['tok_s']:.1f} tok/s "
                        f"(runs {np.round(row['transformers']['all_tok_s'], 1).tolist()}), ratio {row['ratio']:.2f}x")
                    if not args.skip_profile and (name, dtype, batch) == profile_key:
                        log("  profiling where the time goes")
                        prof = profile(m, dtype, eng, prompts, new_tokens, row)
                    del eng

        tiny = loaded.get("tiny") or load("tiny", "float32", tmp)
        vocab = tiny.model.cfg.vocab_size
        util_new = 128 if args.quick else 256
        log(f"slot utilization: 64 sequences, 8 slots, sampled lengths up to {util_new}")
        util = slot_utilization(tiny, 64, 8, util_new, eos_id=vocab - 1)
        spmd = None
        if not args.skip_spmd:
            devices = jax.devices()[:4]
            if len(devices) < 4:
                log("spmd: fewer than 4 devices (XLA_FLAGS set elsewhere?); skipped")
            else:
                log("spmd substitution on 4 fake CPU devices (tiny model)")
                spmd = {"tiny": spmd_substitution(tiny, 16, 64, 64, vocab - 1, devices)}
                if "smollm2" in loaded:
                    log("spmd substitution on 4 fake CPU devices (SmolLM2-135M, fp32)")
                    spmd["smollm2"] = spmd_substitution(loaded["smollm2"], 16, 16, 2, 0, devices, end_to_end=False,
                                                        seq_len=seq_len_for(new_tokens))

    print(f"\nDecode, greedy, N new tokens, prompts of {PROMPT_LENS[0]}-{PROMPT_LENS[1] - 1} tokens "
          f"(best of up to {args.repeats} runs); bandwidth {BW['used_Bps'] / 1e9:.1f} GB/s (numpy copy, R+W), "
          f"matmul {BW['matmul_flops'] / 1e9:.0f} GFLOP/s (numpy fp32)")
    print(f"machine: {describe(host)}; copy {BW['used_Bps'] / 1e9:.1f} GB/s, "
          f"matmul {BW['matmul_flops'] / 1e9:.0f} GFLOP/s")
    print(table(rows))
    print(f"\nSlot utilization ({util['sequences']} sequences, {util['batch_slots']} slots, completion length mean "
          f"{util['length_stats']['mean']:.0f}, p90 {util['length_stats']['p90']:.0f}, "
          f"max {util['length_stats']['max']}):"
          f" continuous {100 * util['continuous_util']:.1f}% ({util['continuous_steps']} steps), static "
          f"{100 * util['static_util']:.1f}% ({util['static_steps']} steps)")
    if prof is not None:
        print(f"\nWhere the time goes ({prof['model']} {prof['dtype']} batch {prof['batch']}):")
        for k in ("compile_s", "generate_wall_ms", "prefill_ms", "decode_ms", "decode_steps", "engine_ms_per_step",
                  "forward_only_ms_per_step", "lm_head_ms",
                  "transformers_ms_per_token_step", "bw_roof_ms_per_step", "flop_roof_ms_per_step"):
            print(f"  {k:<32}{prof[k]:>10.2f}" if isinstance(prof[k], float) else f"  {k:<32}{prof[k]:>10}")
        tr = prof.get("xla_trace", {})
        for k, v in tr.get("thunk_ms_per_step", {}).items():
            print(f"  trace: {k:<70}{v:>8.2f} ms/step")
        if "error" in tr:
            print(f"  trace: {tr['error']}")
    if spmd:
        print("\nSPMD row substitution, 4 fake CPU devices (dp=4), batch 16:")
        for name, s in spmd.items():
            for sub in ("auto", "naive"):
                r = s[sub]
                label = "shard_map" if sub == "auto" else "naive"
                line = f"  {MODELS[name]:<13}{label:<10} substitution alone {r['fill_call_ms']:8.2f} ms/call"
                if "ms_per_call" in r:
                    line += (f"; sampled run {r['ms_per_call']:7.2f} ms/call, {r['ms_per_decode_step']:7.2f} ms/step "
                             f"({r['calls']} calls, {r['decode_steps']} steps)")
                print(line)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    setup = {"models": models, "batches": args.batches, "dtypes": args.dtypes, "new_tokens": new_tokens,
             "repeats": args.repeats, "quick": args.quick, "prompt_lens": list(PROMPT_LENS),
             "jax": jax.__version__, "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "host": host}
    result = {"setup": setup, "machine": BW, "results": rows, "slot_utilization": util, "profile": prof, "spmd": spmd}
    out_path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
