"""Train-step throughput of asyncrl's Trainer vs the same model's forward+backward in transformers/PyTorch (CPU).

Both sides get the same batch shape, fp32 weights, and a policy-gradient-shaped loss on the completion tokens.
Ours is a whole optimizer step (fused logprobs, loss, grads, AdamW); PyTorch is timed as forward+backward and as
forward+backward+AdamW. Each framework runs in its own child process so that peak RSS is its own; for ours the
compiled program's own memory analysis is reported too. Configs: the `tiny` preset and the SmolLM2-135M
architecture with random weights. Throughputs are only comparable within one run (machines and load vary).

    python benchmarks/train_step.py [--configs tiny smollm2-135m] [--batch 4] [--prompt-len 32]
                                    [--completion-len 96] [--repeats 3] [--remat 0|1] [--grad-accum N]
    python benchmarks/train_step.py --no-torch ...   # ours alone, e.g. remat against micro-batching (no file)

Writes benchmarks/results/train_step.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results" / "train_step.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent
MiB = 2**20


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def synthetic_rollouts(vocab: int, batch: int, group: int, prompt_len: int, completion_len: int, seed: int = 0):
    """`batch` sequences of exactly prompt_len + completion_len tokens, in groups with mixed 0/1 rewards."""
    from asyncrl.rollout import Completion, Prompt, Rollout

    rng = np.random.default_rng(seed)
    out = []
    for g in range(batch // group):
        comps = [Completion(tokens=rng.integers(1, vocab, completion_len).astype(np.int32),
                            logprobs=-rng.uniform(0.5, 4.0, completion_len).astype(np.float32),
                            forced=np.zeros(completion_len, bool), versions=np.zeros(completion_len, np.int32),
                            reward=float(i % 2)) for i in range(group)]
        out.append(Rollout(prompt=Prompt(g, SimpleNamespace(id=str(g), answer=""), group), completions=comps,
                           prompt_tokens=rng.integers(1, vocab, prompt_len).astype(np.int32)))
    return out


def seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Fastest of `repeats` calls: on a shared machine the minimum is the run a neighbour did not slow down
    (timeit's advice). PyTorch's spinning OpenMP threads suffer far more from contention than XLA's pool."""
    for _ in range(warmup):  # compile, allocator, oneDNN primitive caches
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def run_jax(args) -> dict:
    import jax
    import jax.numpy as jnp

    from asyncrl.models import Model, preset
    from asyncrl.train.batch import build_batch
    from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
    from asyncrl.train.loss_config import LossConfig
    from asyncrl.train.mesh import shard_batch
    from asyncrl.train.trainer import Trainer

    cfg = preset(args.config)
    loss_cfg = LossConfig(name="grpo")
    train_cfg = TrainConfig(train_batch_size=args.batch, lr=1e-5, logprob_chunk_size=args.chunk_size,
                            remat=bool(args.remat), grad_accum_steps=args.grad_accum)
    trainer = Trainer(Model(cfg), train_cfg, loss_cfg, ShardingConfig(mesh=MeshConfig(dp=1, fsdp=-1)),
                      devices=jax.devices()[:1])
    trainer.init(jax.random.key(0))
    batch = build_batch(synthetic_rollouts(cfg.vocab_size, args.batch, args.group, args.prompt_len,
                                           args.completion_len), loss_cfg, pad_to_multiple=1)
    with jax.set_mesh(trainer.mesh):
        start = time.perf_counter()
        compiled = trainer._step_fn.lower(trainer.params, trainer.opt_state, shard_batch(batch, trainer.shardings),
                                          jnp.int32(0)).compile()
        compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    step_s = seconds(lambda: trainer.step(batch), args.repeats)
    return {
        "step_s": step_s,
        "compile_s": compile_s,
        "compiled_temp_bytes": int(mem.temp_size_in_bytes),
        "compiled_argument_bytes": int(mem.argument_size_in_bytes),
        "compiled_output_bytes": int(mem.output_size_in_bytes),
        "compiled_alias_bytes": int(mem.alias_size_in_bytes),
        "compiled_peak_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                                   + mem.temp_size_in_bytes),
        "peak_rss_bytes": peak_rss_bytes(),
        "params": cfg.num_params(),
    }


def run_torch(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.models import preset

    torch.manual_seed(0)
    hf = preset(args.config).to_hf_dict()
    hf.pop("architectures")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf),
                                             torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = np.random.default_rng(0)
    T = args.prompt_len + args.completion_len
    tokens = torch.tensor(rng.integers(1, model.config.vocab_size, (args.batch, T)), dtype=torch.long)
    mask = torch.zeros(args.batch, T - 1)
    mask[:, args.prompt_len - 1:] = 1.0
    weights = mask / mask.sum()
    adv = torch.tensor(rng.standard_normal(args.batch), dtype=torch.float32)[:, None]

    def fwd_bwd() -> None:
        logits = model(tokens).logits[:, :-1].float()  # [B, T-1, V]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = -(weights * adv * lp).sum()
        loss.backward()

    def fwd_bwd_adamw() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # PyTorch's CPU kernels keep getting faster over the first ~3 calls of a shape (seen here): warm up 3 times.
    out = {"fwd_bwd_s": seconds(lambda: (fwd_bwd(), model.zero_grad(set_to_none=True)), args.repeats, warmup=3),
           "fwd_bwd_adamw_s": seconds(fwd_bwd_adamw, args.repeats)}
    out["peak_rss_bytes"] = peak_rss_bytes()
    out["threads"] = torch.get_num_threads()
    return out


def child(framework: str, config: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", framework, "--configs", config, "--batch", str(args.batch),
           "--group", str(args.group), "--prompt-len", str(args.prompt_len), "--completion-len",
           str(args.completion_len), "--repeats", str(args.repeats), "--chunk-size", str(args.chunk_size),
           "--remat", str(args.remat), "--grad-accum", str(args.grad_accum)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{framework} benchmark of {config} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "smollm2-135m"])
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--group", type=int, default=2, help="sequences per prompt group")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=1024, help="train.logprob_chunk_size")
    parser.add_argument("--remat", type=int, choices=[0, 1], default=0, help="train.remat of ours")
    parser.add_argument("--grad-accum", type=int, default=1, help="train.grad_accum_steps of ours")
    parser.add_argument("--no-torch", action="store_true", help="time ours alone (no ratio: a probe, not a result)")
    parser.add_argument("--child", choices=["jax", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        sys.path.insert(0, str(ROOT))
        args.config = args.configs[0]
        print(json.dumps(run_jax(args) if args.child == "jax" else run_torch(args)))
        return

    tokens = args.batch * (args.prompt_len + args.completion_len)
    if args.no_torch:
        for config in args.configs:
            ours = child("jax", config, args)
            print(json.dumps({"config": config, "remat": args.remat, "grad_accum": args.grad_accum,
                              "step_s": ours["step_s"], "tok_s": tokens / ours["step_s"],
                              "compiled_peak_MiB": ours["compiled_peak_bytes"] / MiB,
                              "peak_rss_MiB": ours["peak_rss_bytes"] / MiB}))
        return
    rows = []
    for config in args.configs:
        ours, torch_ = child("jax", config, args), child("torch", config, args)
        rows.append({
            "config": config, "params": ours["params"], "tokens_per_step": tokens,
            "asyncrl_step_tok_s": tokens / ours["step_s"],
            "torch_fwd_bwd_tok_s": tokens / torch_["fwd_bwd_s"],
            "torch_fwd_bwd_adamw_tok_s": tokens / torch_["fwd_bwd_adamw_s"],
            "ratio_vs_torch_fwd_bwd": torch_["fwd_bwd_s"] / ours["step_s"],
            "ratio_vs_torch_fwd_bwd_adamw": torch_["fwd_bwd_adamw_s"] / ours["step_s"],
            "asyncrl": ours, "torch": torch_,
        })

    print(f"batch={args.batch} x T={args.prompt_len}+{args.completion_len} fp32 on CPU; tokens/s (higher is better)")
    print(f"{'config':<14} {'params':>8} {'ours step':>10} {'torch f+b':>10} {'torch f+b+opt':>14} {'ours/f+b':>9} "
          f"{'ours/f+b+opt':>13} {'compiled MiB':>13} {'ours RSS':>9} {'torch RSS':>10}")
    for r in rows:
        print(f"{r['config']:<14} {r['params'] / 1e6:>7.1f}M {r['asyncrl_step_tok_s']:>10.0f} "
              f"{r['torch_fwd_bwd_tok_s']:>10.0f} {r['torch_fwd_bwd_adamw_tok_s']:>14.0f} "
              f"{r['ratio_vs_torch_fwd_bwd']:>9.2f} {r['ratio_vs_torch_fwd_bwd_adamw']:>13.2f} "
              f"{r['asyncrl']['compiled_peak_bytes'] / MiB:>13.1f} {r['asyncrl']['peak_rss_bytes'] / MiB:>9.0f} "
              f"{r['torch']['peak_rss_bytes'] / MiB:>10.0f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: getattr(args, k) for k in ("configs", "batch", "group", "prompt_len", "completion_len", "repeats",
                                           "chunk_size", "remat", "grad_accum")}
    RESULTS.write_text(json.dumps({"setup": setup, "results": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
