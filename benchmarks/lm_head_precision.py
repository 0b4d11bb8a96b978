"""Which LM-head precision the trainer needs, measured on a real model (issue #26: "the cheapest precision whose
sampler-versus-trainer logprob gap stays within a stated bound").

SmolLM2-135M-Instruct (the offline real model) samples completions the way a run does: the inference engine, bf16
weights and KV cache, temperature 1. Its logprobs are the sampler's. The trainer's logprobs of the same tokens come
from the fp32 master weights: the model's hidden states, then the LM head (an f32 matmul) at each TPU precision,
emulated in NumPy since XLA:CPU computes every precision exactly:
- 1 pass (DEFAULT): both operands rounded to bf16;
- 3 passes (HIGH, bf16_3x): hi*hi + hi*lo + lo*hi of the bf16 splits;
- exact: float64.

The bound: a precision may add at most 10% to the mean |trainer - sampler| logprob gap that bf16 inference already
has (that gap is what the importance ratios correct for; the LM head's rounding should not be a visible part of
it), and at most 0.01 nats to the largest per-token error against exact.

    PYTHONPATH=. .venv/bin/python benchmarks/lm_head_precision.py [--prompts 16 --new-tokens 96]
        [--trainer-dtype bfloat16]

`--trainer-dtype bfloat16` (issue #39, `model.logits_precision`): the trainer runs bf16 weights too
(train.compute_dtype: bfloat16), so its hidden states and LM head are bf16 before the head casts them to fp32. Both
operands are then bf16 values, whose low bf16 halves are zero: HIGH's two extra passes add exactly nothing, and
DEFAULT (one pass, fp32 accumulation) gives the same logits. Each row also reports the k3 estimate of
KL(sampler || trainer) per token, r - 1 - log r with r = pi_trainer / pi_sampler.

Writes benchmarks/results/lm_head_precision.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.models import from_pretrained  # noqa: E402
from asyncrl.models.sources import convert_smollm2  # noqa: E402
from asyncrl.models.tokenizer import Tokenizer  # noqa: E402
from asyncrl.rollout import Prompt  # noqa: E402
from benchmarks.machine import describe, machine  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PROMPTS = ["What is 17 times 23?", "Solve for x: 3x + 7 = 22.", "Name three prime numbers above 50.",
           "A train travels 120 km in 1.5 hours. What is its speed?", "What is the derivative of x^3?",
           "Write the number 1000 in binary.", "If a = 4 and b = 9, what is sqrt(a * b)?",
           "How many minutes are in a week?"]


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return logits[np.arange(len(targets)), targets] - lse


def head(h: np.ndarray, W: np.ndarray, passes: int | None) -> np.ndarray:
    """h [n, D] @ W [D, V] as the MXU computes an f32 matmul in `passes` bf16 passes (None: float64)."""
    if passes is None:
        return h.astype(np.float64) @ W.astype(np.float64)
    hi_h, hi_w = _bf16(h), _bf16(W)
    out = hi_h @ hi_w
    if passes >= 3:
        lo_h, lo_w = _bf16(h - hi_h), _bf16(W - hi_w)
        out = out + hi_h @ lo_w + lo_h @ hi_w
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--sampler-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--trainer-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    suffix = "" if args.trainer_dtype == "float32" else "_bf16_trainer"
    args.out = args.out or str(HERE / "results" / f"lm_head_precision{suffix}.json")
    host = machine()
    path = convert_smollm2()
    model, params = from_pretrained(path, dtype=jnp.float32)
    tok = Tokenizer.from_folder(path)
    cfg = InferenceConfig(group_size=1, max_decode_batch_size=args.prompts, max_prefill_prompts=args.prompts,
                          max_seq_len=256, max_new_tokens=args.new_tokens, temperature=1.0,
                          params_dtype=args.sampler_dtype, kv_cache_dtype=args.sampler_dtype, min_prefill_bucket=32)
    sampler = jax.tree.map(lambda x: x.astype(args.sampler_dtype), params)
    eng = Engine(model, sampler, cfg, tok, seed=0)
    prompts = [tok.encode_prompt(PROMPTS[i % len(PROMPTS)], chat=True) for i in range(args.prompts)]
    out = eng.generate([Request(Prompt(i), p) for i, p in enumerate(prompts)], drain=True)
    trainer = params if args.trainer_dtype == "float32" else jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    W = np.asarray(model.lm_head_weight(trainer).astype(jnp.float32))
    names = ("1 pass (DEFAULT)", "3 passes (HIGH)", "exact")
    rows = {name: {"gap_to_sampler": [], "err_to_exact": [], "k3": []} for name in names}
    n_tokens = 0
    for r in out:
        c, p = r.completions[0], r.prompt_tokens
        keep = ~c.forced
        seq = np.concatenate([np.asarray(p), c.tokens]).astype(np.int32)
        h, _ = model.apply(trainer, jnp.asarray(seq[None]), jnp.asarray([len(seq)]), apply_lm_head=False)
        h = np.asarray(h[0, len(p) - 1:len(seq) - 1].astype(jnp.float32))  # the states that predict each sampled token
        targets = c.tokens.astype(np.int64)
        exact = _logprobs(head(h, W, None), targets)
        for name, passes in (("1 pass (DEFAULT)", 1), ("3 passes (HIGH)", 3), ("exact", None)):
            lp = _logprobs(head(h, W, passes), targets)
            rows[name]["gap_to_sampler"].append(np.abs(lp - c.logprobs)[keep])
            rows[name]["err_to_exact"].append(np.abs(lp - exact)[keep])
            log_r = (lp - c.logprobs)[keep]
            rows[name]["k3"].append(np.exp(log_r) - 1.0 - log_r)
        n_tokens += int(keep.sum())
    base = float(np.mean(np.concatenate(rows["exact"]["gap_to_sampler"])))
    result = {"machine": host, "model": "SmolLM2-135M-Instruct", "sampled_tokens": n_tokens,
              "sampler_dtype": args.sampler_dtype, "trainer_dtype": args.trainer_dtype, "rows": {}}
    print(f"\nmachine: {describe(host)}; {n_tokens} sampled tokens, {args.sampler_dtype} sampler at temperature 1, "
          f"{args.trainer_dtype} trainer weights")
    print(f"{'LM head':<18}{'mean |lp - sampler|':>21}{'added':>9}{'mean |lp - exact|':>19}{'max |lp - exact|':>18}"
          f"{'within bound':>14}{'k3 / token':>12}")
    for name, r in rows.items():
        gap = float(np.mean(np.concatenate(r["gap_to_sampler"])))
        err = np.concatenate(r["err_to_exact"])
        ok = gap <= 1.1 * base and float(err.max()) <= 0.01
        k3 = float(np.mean(np.concatenate(r["k3"])))
        result["rows"][name] = {"mean_gap_to_sampler": gap, "added": gap / base - 1, "mean_err_to_exact":
                                float(err.mean()), "max_err_to_exact": float(err.max()), "within_bound": ok,
                                "k3_per_token": k3}
        print(f"{name:<18}{gap:>21.5f}{100 * (gap / base - 1):>8.1f}%{float(err.mean()):>19.6f}"
              f"{float(err.max()):>18.5f}"
              f"{'yes' if ok else 'no':>14}{k3:>12.2e}")
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
