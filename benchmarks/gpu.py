"""asyncrl on one GPU: decode and train step against the device's own measured roofline, beside transformers.

One run measures, on the device it finds (CUDA; `--smoke` also runs on a CPU):
- the device: HBM bandwidth by a device-to-device copy (an elementwise pass over 1 GiB of bf16: bytes read +
  written), and the bf16 matmul peak (an 8192^3 product);
- decode with the engine's real program (`inference.Engine`: continuous batching, `decode_and_swap`) for a
  Qwen3-1.7B- and a Qwen3-8B-shaped model with random bf16 weights, at batch 1, 32 and 128: ms per decode step
  at a full batch (calls of `decode_chunk_steps` steps, timed by the engine's own stats, read per call through
  its `between_loops` hook), against the HBM roofline of a step: (weights read + the KV of every row's context)
  / the measured bandwidth. Every row decodes exactly `--new-tokens` tokens (EOS = vocab_size, never sampled);
- the real train step (`train.Trainer.step`: fused logprobs, loss, grads, AdamW; bf16 compute, remat 'dots' as
  configs/v5p64_qwen3_8b.yaml sets it) on the same shapes, MFU = model FLOPs (6 x matmul params + causal
  attention, remat's recompute not counted) / step time / the measured matmul peak. Qwen3-8B's full fp32 Adam
  state does not fit one 80 GB GPU: its train step runs `--train-layers-8b` of its 36 layers (MFU per FLOP is
  what counts; the layers run are recorded);
- transformers `generate` (PyTorch, greedy, exactly N new tokens) on the same shapes, batch and prompts.
JAX and PyTorch each run in a child process of their own, so each has the whole device memory. Each child writes
its figures to a file as it goes, so a run cut short keeps what it measured.

    python benchmarks/gpu.py [--smoke] [--out FILE] [--budget-s 420]

Needs only jax (with the CUDA plugin), flax/optax, numpy, torch and transformers, plus this repository: no Ray,
omegaconf, tensorboardX or math-verify. `--smoke` runs tiny shapes, on a CPU in about a minute.
Writes benchmarks/results/gpu.json (--smoke: gpu_smoke.json) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2**30


def plan(smoke: bool) -> dict[str, Any]:
    """Shapes and sizes of a run (the model shapes as dicts of ModelConfig overrides of a preset)."""
    if smoke:
        return {"models": {"smoke-a": ("qwen3-1.7b", dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                                                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)),
                           "smoke-b": ("qwen3-8b", dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                                                        num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32))},
                "batches": [4, 1], "prompt_len": 16, "new_tokens": 16, "chunk_steps": 4,
                "train": {"batch": 4, "seq_len": 64, "layers": {}}, "copy_bytes": 64 * 2**20, "matmul_n": 512}
    return {"models": {"qwen3-8b": ("qwen3-8b", {}), "qwen3-1.7b": ("qwen3-1.7b", {})},
            "batches": [32, 1, 128], "prompt_len": 128, "new_tokens": 128, "chunk_steps": 16,
            "train": {"batch": 4, "seq_len": 2048, "layers": {"qwen3-8b": 8}}, "copy_bytes": GiB, "matmul_n": 8192}


def model_config(spec: tuple[str, dict]) -> Any:
    from asyncrl.models import preset

    return dataclasses.replace(preset(spec[0]), **spec[1])


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(batch)]


class Results:
    """A child's figures, rewritten to its file after every item."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        pathlib.Path(self.path).write_text(json.dumps(self.data, indent=1))
        print(f"[gpu.py] {key}: {json.dumps(value)[:300]}", file=sys.stderr, flush=True)


def best_s(fn, repeats: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(min(times))


# ---- JAX child ------------------------------------------------------------------------------------------------

def jax_device(res: Results, p: dict) -> tuple[float, float]:
    import jax
    import jax.numpy as jnp

    d = jax.devices()[0]
    x = jnp.ones((p["copy_bytes"] // 2,), jnp.bfloat16)
    neg = jax.jit(lambda x: -x)
    bw = 2 * x.nbytes / best_s(lambda: neg(x).block_until_ready(), 10)
    n = p["matmul_n"]
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))
    mm = jax.jit(lambda a, b: a @ b)
    peak = 2 * n**3 / best_s(lambda: mm(a, b).block_until_ready(), 10)
    res.put("device", {"platform": d.platform, "device_kind": d.device_kind, "jax": jax.__version__,
                       "copy_bandwidth_Bps": bw, "matmul_bf16_flops": peak})
    return bw, peak


def decode_roofline_bytes(cfg: Any, batch: int, ctx: float) -> float:
    """Bytes a decode step must read: every weight (the input embedding only if it is also the LM head: untied,
    a step reads `batch` of its rows) and the bf16 KV of every row's context."""
    embed = cfg.vocab_size * cfg.hidden_size
    weights = cfg.num_params() - (0 if cfg.tie_word_embeddings else embed)
    return 2 * weights + batch * ctx * cfg.kv_bytes_per_token(2)


def jax_decode(cfg: Any, params: Any, batch: int, p: dict, bw: float) -> dict[str, Any]:
    from asyncrl.inference.config import InferenceConfig
    from asyncrl.inference.engine import Engine, Request
    from asyncrl.models import Model
    from asyncrl.rollout import Prompt

    P, N = p["prompt_len"], p["new_tokens"]
    icfg = InferenceConfig(group_size=1, max_decode_batch_size=batch, max_prefill_prompts=batch,
                           max_seq_len=-(-(P + N + 1) // 8) * 8, max_new_tokens=N, temperature=0.0,
                           decode_chunk_steps=p["chunk_steps"], min_prefill_bucket=16)
    eng = Engine(Model(cfg), params, icfg, None, eos_id=cfg.vocab_size)
    rows = prompts(batch, P, cfg.vocab_size)
    calls: list[tuple[float, int]] = []
    eng.between_loops = lambda: calls.append((eng.stats.decode_time, eng.stats.decode_steps))

    def run() -> float:
        calls.clear()
        t = time.perf_counter()
        out = eng.generate([Request(Prompt(i), r) for i, r in enumerate(rows)])
        wall = time.perf_counter() - t
        calls.append((eng.stats.decode_time, eng.stats.decode_steps))
        n = [int((~c.forced).sum()) for r in out for c in r.completions]
        if n != [N] * batch:
            raise RuntimeError(f"expected {N} sampled tokens in each of {batch} rows, got {n}")
        return wall

    t0 = time.perf_counter()
    run()  # compiles prefill and decode
    first_s = time.perf_counter() - t0
    wall = run()
    deltas = [(t1 - t0, s1 - s0) for (t0, s0), (t1, s1) in zip(calls, calls[1:])]
    stepping = [(dt, n) for dt, n in deltas if n > 0]
    step_s = sum(dt for dt, _ in stepping) / sum(n for _, n in stepping)
    roof_s = decode_roofline_bytes(cfg, batch, P + N / 2) / bw
    return {"batch": batch, "prompt_len": P, "new_tokens": N, "ms_per_step": 1e3 * step_s,
            "roofline_ms_per_step": 1e3 * roof_s, "x_roofline": step_s / roof_s, "tok_s_steady": batch / step_s,
            "tok_s_end_to_end": batch * N / wall, "wall_s": wall, "first_run_s_with_compile": first_s,
            "calls": len(deltas), "decode_steps": sum(n for _, n in deltas)}


def train_flops(cfg: Any, tokens: int, seq_len: int) -> float:
    """Model FLOPs of one fwd+bwd: 6 per matmul weight per token (the LM head included, the embedding lookup
    not) + causal attention (2 matmuls x 2 FLOPs x H x Dh x T/2 keys per token and layer, x3 for fwd+bwd)."""
    d, h, k, dh, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    per_layer = d * (h + 2 * k) * dh + h * dh * d + 3 * d * f
    matmul = cfg.num_layers * per_layer + d * cfg.vocab_size
    return tokens * (6 * matmul + 6 * cfg.num_layers * h * dh * seq_len)


def jax_train(cfg: Any, p: dict, peak: float) -> dict[str, Any]:
    import jax

    from asyncrl.models import Model
    from asyncrl.models.attention_impl import choose, platform
    from asyncrl.train.batch import build_batch
    from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
    from asyncrl.train.loss_config import LossConfig
    from asyncrl.train.trainer import Trainer
    from benchmarks.train_step import synthetic_rollouts

    B, T = p["train"]["batch"], p["train"]["seq_len"]
    tcfg = TrainConfig(train_batch_size=B, lr=1e-6, compute_dtype="bfloat16", remat=True, remat_policy="dots")
    loss = LossConfig()
    trainer = Trainer(Model(cfg), tcfg, loss, ShardingConfig(mesh=MeshConfig(dp=1, fsdp=-1)),
                      devices=jax.devices()[:1])
    trainer.init(jax.random.key(0))
    batch = build_batch(synthetic_rollouts(cfg.vocab_size, B, min(B, 8), T // 4, T - T // 4), loss, pad_to_multiple=1)
    t = time.perf_counter()
    trainer.step(batch)
    first_s = time.perf_counter() - t
    step_s = min(trainer.step(batch)["train/step_time_s"] for _ in range(3))
    flops = train_flops(cfg, B * T, T)
    shape = (B, T, cfg.num_heads, cfg.head_dim)
    attn = choose(platform(), jax.numpy.bfloat16, shape, (B, T, cfg.num_kv_heads, cfg.head_dim))
    return {"batch": B, "seq_len": T, "layers": cfg.num_layers, "step_s": step_s, "model_flops": flops,
            "mfu": flops / step_s / peak, "tok_s": B * T / step_s, "first_step_s_with_compile": first_s,
            "remat": "dots", "attention": attn.impl, "attention_reason": attn.reason}


def child_jax(out: str, p: dict, budget_s: float) -> None:
    import gc

    import jax
    import jax.numpy as jnp

    from asyncrl.models import Model

    t0 = time.perf_counter()
    res = Results(out)
    bw, peak = jax_device(res, p)
    over = lambda: time.perf_counter() - t0 > budget_s  # noqa: E731
    # The goals first (batch 32 decode, the train step), then the other batches, in case the budget runs out.
    for first in (True, False):
        for name, spec in p["models"].items():
            cfg = model_config(spec)
            batches = p["batches"][:1] if first else p["batches"][1:]
            params = None
            for b in batches:
                key = f"decode/{name}/{b}"
                if over():
                    res.put(key, {"skipped": "budget"})
                    continue
                params = params or Model(cfg).init_params(jax.random.key(0), jnp.bfloat16)
                try:
                    res.put(key, jax_decode(cfg, params, b, p, bw))
                except Exception as e:  # noqa: BLE001 - e.g. out of memory at batch 128: record it, go on
                    res.put(key, {"error": f"{type(e).__name__}: {str(e)[:500]}"})
                gc.collect()
            del params
            gc.collect()
            if first:
                key = f"train/{name}"
                layers = p["train"]["layers"].get(name, cfg.num_layers)
                if over():
                    res.put(key, {"skipped": "budget"})
                    continue
                try:
                    res.put(key, jax_train(dataclasses.replace(cfg, num_layers=layers), p, peak))
                except Exception as e:  # noqa: BLE001
                    res.put(key, {"error": f"{type(e).__name__}: {str(e)[:500]}"})
                gc.collect()


# ---- PyTorch child --------------------------------------------------------------------------------------------

def child_torch(out: str, p: dict, budget_s: float) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    res = Results(out)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res.put("torch_device", {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
                             "torch": torch.__version__, "transformers": transformers.__version__})
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # bf16 on the GPU; a CPU (--smoke) has no fast bf16 matmul, and only checks the script there.
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    P, N = p["prompt_len"], p["new_tokens"]
    for first in (True, False):
        for name, spec in p["models"].items():
            cfg = model_config(spec)
            hf = cfg.to_hf_dict()
            hf.pop("architectures")
            torch.manual_seed(0)
            with dev:  # random init straight on the device
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf),
                                                         dtype=dtype).eval()
            for b in p["batches"][:1] if first else p["batches"][1:]:
                key = f"hf_generate/{name}/{b}"
                if time.perf_counter() - t0 > budget_s:
                    res.put(key, {"skipped": "budget"})
                    continue
                ids = torch.tensor(prompts(b, P, cfg.vocab_size), device=dev)

                def gen(n: int) -> float:
                    with torch.inference_mode():
                        sync()
                        t = time.perf_counter()
                        o = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
                        sync()
                    if o.shape[1] - P != n:
                        raise RuntimeError(f"transformers generated {o.shape[1] - P} tokens, expected {n}")
                    return time.perf_counter() - t

                try:
                    gen(4)
                    short, wall = gen(N // 4), gen(N)
                    step_s = (wall - short) / (N - N // 4)
                    res.put(key, {"batch": b, "new_tokens": N, "dtype": str(dtype), "wall_s": wall,
                                  "tok_s_end_to_end": b * N / wall, "ms_per_step": 1e3 * step_s,
                                  "tok_s_steady": b / step_s})
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, go on
                    res.put(key, {"error": f"{type(e).__name__}: {str(e)[:500]}"})
            model = None  # noqa: F841 - frees the weights before the next shape's
            if dev.type == "cuda":
                torch.cuda.empty_cache()


# ---- parent ---------------------------------------------------------------------------------------------------

def driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def child(kind: str, smoke: bool, budget_s: float, tmp: pathlib.Path) -> dict[str, Any]:
    out = tmp / f"gpu_{kind}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"))
    cmd = [sys.executable, __file__, "--child", kind, "--child-out", str(out), "--budget-s", str(budget_s)]
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd + (["--smoke"] if smoke else []), cwd=ROOT, env=env, timeout=budget_s + 90).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    data = json.loads(out.read_text()) if out.exists() else {}
    data[f"{kind}_child"] = {"returncode": rc, "seconds": time.perf_counter() - t}
    return data


def table(r: dict[str, Any], p: dict) -> str:
    dev = r.get("device", {})
    lines = [f"device: {r.get('nvidia_smi') or dev.get('device_kind')} | jax {dev.get('jax')} | torch "
             f"{r.get('torch_device', {}).get('torch')} | copy {dev.get('copy_bandwidth_Bps', 0) / 1e9:.1f} GB/s | "
             f"bf16 matmul {dev.get('matmul_bf16_flops', 0) / 1e12:.2f} TFLOP/s",
             f"decode: prompt {p['prompt_len']}, {p['new_tokens']} new tokens, greedy, bf16",
             f"{'model':<12} {'batch':>5} {'ms/step':>8} {'roof ms':>8} {'x roof':>7} {'tok/s':>9} {'HF ms/step':>10} "
             f"{'HF tok/s':>9} {'vs HF':>6}"]
    for name in p["models"]:
        for b in sorted(p["batches"]):
            o, h = r.get(f"decode/{name}/{b}", {}), r.get(f"hf_generate/{name}/{b}", {})
            if "ms_per_step" not in o:
                lines.append(f"{name:<12} {b:>5} {o.get('error') or o.get('skipped') or 'missing'}")
                continue
            hf = (f"{h['ms_per_step']:>10.2f} {h['tok_s_end_to_end']:>9.0f} "
                  f"{o['tok_s_end_to_end'] / h['tok_s_end_to_end']:>6.2f}") if "ms_per_step" in h else \
                f"{(h.get('error') or h.get('skipped') or 'missing')[:40]:>10}"
            lines.append(f"{name:<12} {b:>5} {o['ms_per_step']:>8.2f} {o['roofline_ms_per_step']:>8.2f} "
                         f"{o['x_roofline']:>7.2f} {o['tok_s_end_to_end']:>9.0f} {hf}")
    lines.append(f"train step (bf16, remat dots): {'model':<12} {'layers':>6} {'B x T':>10} {'step s':>8} "
                 f"{'MFU':>6} attention")
    for name in p["models"]:
        t = r.get(f"train/{name}", {})
        if "mfu" in t:
            lines.append(f"{'':<30} {name:<12} {t['layers']:>6} {t['batch']:>4} x {t['seq_len']:<5} "
                         f"{t['step_s']:>8.3f} {t['mfu']:>6.3f} {t['attention']}")
        else:
            lines.append(f"{'':<30} {name:<12} {t.get('error') or t.get('skipped') or 'missing'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script end to end, on a CPU too")
    ap.add_argument("--out", default=None, help="the JSON (default benchmarks/results/gpu.json, gpu_smoke.json)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run (default 420; --smoke 900, for a loaded CPU): 70%% to JAX, the "
                    "rest to PyTorch; items past it are skipped")
    ap.add_argument("--child", choices=["jax", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    p = plan(args.smoke)
    if args.budget_s is None:
        args.budget_s = 900.0 if args.smoke else 420.0
    if args.child:
        sys.path.insert(0, str(ROOT))
        (child_jax if args.child == "jax" else child_torch)(args.child_out, p, args.budget_s)
        return
    t0 = time.perf_counter()
    out = pathlib.Path(args.out) if args.out else RESULTS / ("gpu_smoke.json" if args.smoke else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    r: dict[str, Any] = {"smoke": args.smoke, "nvidia_smi": driver(), "plan": {k: v for k, v in p.items()}}
    r |= child("jax", args.smoke, 0.7 * args.budget_s, out.parent)
    r |= child("torch", args.smoke, max(args.budget_s - (time.perf_counter() - t0), 60.0), out.parent)
    r["total_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(r, indent=1) + "\n")
    for kind in ("jax", "torch"):  # the children's running files: what a run cut short would have kept
        (out.parent / f"gpu_{kind}.json").unlink(missing_ok=True)
    print(table(r, p))
    print(f"wrote {out} ({r['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
