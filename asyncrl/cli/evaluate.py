"""Evaluate a checkpoint on a task's held-out set with the inference engine: mean reward and pass@k.

    python -m asyncrl.evaluate --model DIR --task NAME [--n K] [--temperature T] [--max-new-tokens N]
        [--limit P] [--seed S] [--out OUT.jsonl] [--chat] [--max-decode-batch-size B] [task.key=value ...]

`--task` names a preset in configs/task/ (digits, arithmetic, gsm_symbolic, math_files); `task.*` overrides
follow, e.g. `task.eval_size=50`. `--model smollm2` evaluates the packaged SmolLM2-135M-Instruct.

Every prompt is sampled K times and graded by the task's verifier. OUT gets one JSONL row per completion,
{id, sample, prompt, answer, completion, reward, reason, extracted, tokens, finish_reason}, in eval-set order;
OUT.summary.json and stdout get mean reward, pass@1..K (the unbiased estimator: a completion passes when its
reward is 1), reason and finish counts, and the same per source when the task mixes several. A prompt that
leaves no room to generate within the context is reported on stderr, counted as skipped, and not sampled.

With several replicas (devices) and temperature > 0 the samples depend on which replica took which prompt, so
only greedy runs (or --devices 1) repeat exactly.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.tasks import REASONS, Sample, Score, TaskConfig, summarize_rewards
from asyncrl.validate import ConfigError

FINISH_REASONS = ("eos", "length")


class EvalError(Exception):
    """A bad flag, task or model folder; the message names it. main() prints it and exits 2."""


@dataclass
class EvalPrompt:
    sample: Sample
    tokens: list[int]


def load_task_config(name: str, overrides: Sequence[str]) -> TaskConfig:
    """The `task` section of configs/task/<name>.yaml with `task.*` overrides applied, validated."""
    from asyncrl.config.loader import groups, load_config

    presets = groups().get("task", [])
    if name not in presets:
        raise EvalError(f"--task {name!r} is not a preset in configs/task/: choose one of {presets}")
    for item in overrides:
        key = item.partition("=")[0].strip().lstrip("+")
        if key == "task":
            raise EvalError(f"override {item!r}: name the task with --task, not task=...")
        if not key.startswith("task."):
            raise EvalError(f"override {item!r}: only task.* keys apply to evaluation (e.g. task.eval_size=50); "
                            "sampling is set with flags (--temperature, --max-new-tokens, ...)")
    try:
        return load_config("default", [f"task={name}", *overrides]).task
    except ConfigError as e:
        raise EvalError(f"--task {name}: {e}") from None


def encode_prompts(
    samples: Iterable[Sample], tokenizer: Any, chat: bool, context: int
) -> tuple[list[EvalPrompt], list[dict]]:
    """Tokenize each sample's prompt; those that leave no room for one generated token within `context` (or are
    empty) are returned separately as {id, prompt_tokens, why} instead of reaching the engine."""
    kept: list[EvalPrompt] = []
    skipped: list[dict] = []
    for s in samples:
        toks = [int(t) for t in tokenizer.encode_prompt(s.prompt, chat=chat)]
        if not toks:
            skipped.append({"id": s.id, "prompt_tokens": 0, "why": "empty prompt"})
        elif len(toks) >= context:
            skipped.append({"id": s.id, "prompt_tokens": len(toks), "why": f"prompt of {len(toks)} tokens leaves no "
                            f"room to generate within the context of {context}"})
        else:
            kept.append(EvalPrompt(s, toks))
    return kept, skipped


def summarize(rows: Sequence[dict], prompts: Sequence[EvalPrompt], n: int) -> dict:
    """Mean reward, pass@1..n, reason and finish counts of `rows` (n per prompt, in prompt order)."""
    rewards = [[r["reward"] for r in rows[i * n : (i + 1) * n]] for i in range(len(prompts))]
    stats = summarize_rewards(rewards)
    reasons = collections.Counter(r["reason"] for r in rows)
    finish = collections.Counter(r["finish_reason"] for r in rows)
    return {
        "prompts": len(prompts),
        "samples": len(rows),
        "mean_reward": stats["mean_reward"],
        **{f"pass@{k}": stats[f"pass@{k}"] for k in range(1, n + 1)},
        "reasons": {k: reasons[k] for k in REASONS if reasons[k]},
        "finish_reasons": {k: finish[k] for k in FINISH_REASONS if finish[k]},
    }


def summary_table(summary: dict) -> str:
    def block(s: dict, indent: str = "") -> list[str]:
        out = [f"{indent}{'prompts':<14}{s['prompts']}", f"{indent}{'samples':<14}{s['samples']}",
               f"{indent}{'mean reward':<14}{s['mean_reward']:.4f}"]
        out += [f"{indent}{key:<14}{v:.4f}" for key, v in s.items() if key.startswith("pass@")]
        out.append(f"{indent}{'reasons':<14}" + " ".join(f"{k}={v}" for k, v in s["reasons"].items()))
        out.append(f"{indent}{'finish':<14}" + " ".join(f"{k}={v}" for k, v in s["finish_reasons"].items()))
        return out

    lines = [f"task {summary['task']}  model {summary['model']}  n={summary['n']}  "
             f"temperature={summary['temperature']}  max_new_tokens={summary['max_new_tokens']}"]
    lines += block(summary)
    lines.append(f"{'skipped':<14}{len(summary['skipped'])} (too long for the context of {summary['context']})")
    for label, s in summary.get("by_task", {}).items():
        lines.append(f"[{label}]")
        lines += block(s, "  ")
    return "\n".join(lines)


def resolve_model(arg: str) -> str:
    """The HF folder `--model` names: a folder with config.json and a tokenizer, or 'smollm2' (converted once)."""
    if arg == "smollm2" and not os.path.isdir(arg):
        from asyncrl.models.sources import convert_smollm2

        try:
            return convert_smollm2()
        except (FileNotFoundError, ImportError) as e:
            raise EvalError(f"--model smollm2: {e}") from None
    if not os.path.isdir(arg):
        raise EvalError(f"--model {arg!r}: no such folder (expected a Hugging Face folder, or 'smollm2')")
    if not os.path.isfile(os.path.join(arg, "config.json")):
        raise EvalError(f"--model {arg!r}: no config.json, so not a Hugging Face model folder")
    if not any(os.path.isfile(os.path.join(arg, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise EvalError(f"--model {arg!r}: no tokenizer.json or tokenizer_config.json; eval prompts are text")
    return arg


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True,
                    help="Hugging Face folder (config.json + safetensors + tokenizer), or 'smollm2'")
    ap.add_argument("--task", required=True, help="task preset in configs/task/")
    ap.add_argument("overrides", nargs="*", help="task.key=value overrides, e.g. task.eval_size=50")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt; pass@k is reported for every k <= n")
    ap.add_argument("--temperature", type=float, default=None, help="default 1.0 when --n > 1, else 0 (greedy)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="evaluate at most this many prompts (eval-set order)")
    ap.add_argument("--max-decode-batch-size", type=int, default=32, help="in-flight rows per replica")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="context limit for prompt + completion (default: the model's max_position_embeddings)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (the eval set is chosen by task.seed)")
    ap.add_argument("--out", default=None, help="per-sample JSONL (default eval_<task>.jsonl)")
    ap.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template too")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--devices", type=int, default=None, help="use the first N local devices (default: all)")
    ap.add_argument("--tp", type=int, default=1, help="devices per replica (tensor parallel)")
    args = ap.parse_intermixed_args(argv)
    for flag, value, low in (("--n", args.n, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--limit", args.limit, 1), ("--max-decode-batch-size", args.max_decode_batch_size, 1),
                             ("--max-seq-len", args.max_seq_len, 2), ("--devices", args.devices, 1),
                             ("--tp", args.tp, 1), ("--seed", args.seed, 0)):
        if value is not None and value < low:
            ap.error(f"{flag}={value} is invalid: must be >= {low}")
    if args.temperature is None:
        args.temperature = 1.0 if args.n > 1 else 0.0
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature} is invalid: must be >= 0 (0 = greedy)")
    args.out = args.out or f"eval_{args.task}.jsonl"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    task_cfg = load_task_config(args.task, args.overrides)  # before any JAX work: a typo fails in milliseconds
    folder = resolve_model(args.model)

    import jax
    from tqdm import tqdm

    from asyncrl.envs import build_task
    from asyncrl.inference.config import InferenceConfig
    from asyncrl.inference.engine import Request
    from asyncrl.inference.replicas import ReplicaSet
    from asyncrl.models import from_pretrained
    from asyncrl.models.tokenizer import Tokenizer
    from asyncrl.rollout import Prompt
    from asyncrl.tasks import Verifier

    task = build_task(task_cfg)
    tokenizer = Tokenizer.from_folder(folder)
    model, params = from_pretrained(folder, dtype=args.dtype)
    context = args.max_seq_len or model.cfg.max_position_embeddings
    samples = itertools.islice(task.samples("eval", task_cfg.seed), args.limit)
    prompts, skipped = encode_prompts(samples, tokenizer, args.chat, context)
    for s in skipped:
        print(f"skipped {s['id']}: {s['why']}", file=sys.stderr)
    if not prompts:
        print(f"error: --task {args.task}: no eval prompts to run ({len(skipped)} skipped)", file=sys.stderr)
        return 1
    if args.n > 1 and args.temperature == 0:
        print(f"warning: --n {args.n} with --temperature 0 draws {args.n} identical greedy samples; pass@k > 1 "
              "then equals pass@1", file=sys.stderr)

    devices = jax.local_devices()[: args.devices] if args.devices else jax.local_devices()
    longest = max(len(p.tokens) for p in prompts)
    max_seq_len = min(context, -(-(longest + args.max_new_tokens + 1) // 8) * 8)
    try:
        cfg = InferenceConfig(
            group_size=args.n, max_decode_batch_size=args.max_decode_batch_size, max_prefill_prompts=8,
            max_seq_len=max_seq_len, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            tp=args.tp, params_dtype=args.dtype, kv_cache_dtype=args.dtype,
        )
        replicas = ReplicaSet(model, params, cfg, tokenizer, devices=devices, seed=args.seed, eos_id=tokenizer.eos_id)
    except ValueError as e:  # e.g. --tp not dividing the devices; the message names the inference field
        raise EvalError(f"{e} (flags --tp/--devices/--max-decode-batch-size)") from None

    with Verifier(task, task_cfg.verifier) as verifier:
        bar = tqdm(total=len(prompts), desc=f"eval {args.task}", unit="prompt", file=sys.stderr)
        requests = [Request(Prompt(i, p.sample, args.n), p.tokens) for i, p in enumerate(prompts)]
        rollouts = replicas.generate(requests, on_group=lambda _: bar.update(1))
        bar.close()
        items = [(c.text, ro.prompt.sample) for ro in rollouts for c in ro.completions]
        print(f"grading {len(items)} completions", file=sys.stderr)
        scores: list[Score] = verifier.score_batch(items)

    rows: list[dict] = []
    for ro in rollouts:
        s = ro.prompt.sample
        for k, c in enumerate(ro.completions):
            score = scores[len(rows)]
            keep = ~(c.forced & (c.tokens == tokenizer.eos_id))  # the length-limit EOS was not generated
            rows.append({"id": s.id, "sample": k, "prompt": s.prompt, "answer": s.answer, "completion": c.text,
                         "reward": score.reward, "reason": score.reason, "extracted": score.extracted,
                         "tokens": np.asarray(c.tokens)[keep].tolist(), "finish_reason": c.finish_reason})

    summary = {"task": args.task, "model": args.model, "n": args.n, "temperature": args.temperature,
               "max_new_tokens": args.max_new_tokens, "seed": args.seed, "context": context,
               **summarize(rows, prompts, args.n), "skipped": skipped}
    labels = [str(p.sample.metadata.get("task", task.label)) for p in prompts]
    if len(set(labels)) > 1:  # a mixture: pass@k over MATH-500 and AIME together would mean little
        summary["by_task"] = {}
        for label in dict.fromkeys(labels):
            idx = [i for i, lab in enumerate(labels) if lab == label]
            summary["by_task"][label] = summarize([r for i in idx for r in rows[i * args.n : (i + 1) * args.n]],
                                                  [prompts[i] for i in idx], args.n)

    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, args.out)
    with open(args.out + ".summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(summary_table(summary))
    print(f"wrote {len(rows)} rows to {args.out} and the summary to {args.out}.summary.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
