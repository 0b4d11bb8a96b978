"""Router replay on the tiny MoE in bf16: how far the trainer's teacher-forced logprobs sit from the sampler's, and
what share of tokens it routes differently, with the sampler `--lag` optimizer steps behind (max_lag 2), with and
without replaying the sampler's routing (train.moe.router_replay).

The sampler is the inference engine with router replay on (`Engine(record_routes=True)`: bf16 weights and KV cache;
XLA:CPU decodes in fp32 from the bf16 weights), which records each fed model token's experts at every MoE layer
(int8, Lm x k = 2 x 2 = 4 bytes a token). The completions go through `build_batch` into an RLBatch, and the trainer
scores them with the train step's own `token_logprobs` in bf16 (train.compute_dtype=bfloat16), passing the batch's
`expert_ids` or not. The lagged trainer's fp32 master weights are the sampler's after `--lag` sign-of-gradient steps
(Adam's first steps) of lr `--lr` on a GRPO-like objective (the sampled completions' logprobs times random +-1
advantages), then cast to bf16. Lag 0 is the same weights: what bf16 numerics alone (cached decode against one full
forward) do to the routing.

    python benchmarks/router_replay.py [--prompts 16] [--tokens 48] [--lag 2] [--lr 1e-4]

Prints a table; writes benchmarks/results/router_replay.json. Correctness figures: no timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.models import Model, params as params_lib, preset  # noqa: E402
from asyncrl.rollout import Prompt  # noqa: E402
from asyncrl.train.batch import build_batch  # noqa: E402
from asyncrl.train.loss_config import LossConfig  # noqa: E402
from asyncrl.train.step import token_logprobs  # noqa: E402

EOS = 1


def sample(model, params, prompts, n, seed):
    """[B, P] prompts -> the engine's RLBatch (its `expert_ids`: the recorded routing, -1 at prompt positions and
    at each completion's last, never-fed token)."""
    B, P = prompts.shape
    cfg = InferenceConfig(group_size=1, max_decode_batch_size=B, max_prefill_prompts=B, max_seq_len=P + n + 8,
                          max_new_tokens=n, temperature=1.0, params_dtype="bfloat16", kv_cache_dtype="bfloat16",
                          min_prefill_bucket=8)
    eng = Engine(model, params, cfg, None, eos_id=EOS, seed=seed, record_routes=True)
    out = eng.generate([Request(Prompt(i, None, 1), [int(t) for t in row]) for i, row in enumerate(prompts)])
    for r in out:
        for c in r.completions:
            c.reward = 0.0
    return build_batch(sorted(out, key=lambda r: r.prompt.position), LossConfig(name="grpo"))


def lagged(model, params, full, n, lr, lag, key):
    """`lag` sign-of-gradient steps on sum(logprob * advantage), advantages +-1 per sequence."""
    for i in range(lag):
        adv = jnp.sign(jax.random.normal(jax.random.fold_in(key, i), (full.shape[0], 1)))
        g = jax.grad(lambda p: jnp.sum(model.get_logprobs(p, full, n) * adv))(params)
        params = jax.tree.map(lambda w, d: w + lr * jnp.sign(d), params, g)
    return params


def measure(model, params, batch, replay):
    tokens, lens = jnp.asarray(batch.tokens), jnp.asarray(batch.seq_lens)
    ids = jnp.asarray(batch.expert_ids) if replay else None
    lp = np.asarray(jax.jit(lambda p, t, n, i: token_logprobs(model, p, t, n, 1.0, 1024, i)[0])(params, tokens, lens,
                                                                                                 ids))
    _, _, used = model.apply_routed(params, tokens, lens, apply_lm_head=False, expert_ids=ids)
    mask = batch.loss_mask[:, 1:]
    d = np.abs(lp - batch.sampler_logprobs[:, 1:])[mask]
    recorded = batch.expert_ids[..., 0, 0] >= 0  # the fed model tokens
    got, want = np.sort(np.asarray(used), -1)[recorded], np.sort(batch.expert_ids, -1)[recorded]
    return {"mean_abs_logprob_diff": float(d.mean()), "max_abs_logprob_diff": float(d.max()),
            "token_layers_routed_differently": float(np.mean(np.any(got != want, -1))),
            "tokens_routed_differently": float(np.mean(np.any(got != want, (-1, -2)))),
            "tokens": int(mask.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--lag", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "router_replay.json"))
    args = ap.parse_args()
    model = Model(preset("tiny_moe"))
    key = jax.random.PRNGKey(args.seed)
    master = model.init_params(key)  # the trainer's fp32 master weights; the sampler gets them cast to bf16
    params = params_lib.cast(master, jnp.bfloat16)
    prompts = np.asarray(jax.random.randint(jax.random.fold_in(key, 1), (args.prompts, args.prompt_len), 3,
                                            model.cfg.vocab_size))
    batch = sample(model, params, prompts, args.tokens, args.seed)
    full = jnp.asarray(batch.tokens)
    rows = []
    for lag in sorted({0, args.lag}):
        moved = lagged(model, master, full, jnp.asarray(batch.seq_lens), args.lr, lag, jax.random.fold_in(key, 3))
        trainer = params_lib.cast(moved, jnp.bfloat16)
        for replay in (False, True):
            rows.append({"lag": lag, "replay": replay, **measure(model, trainer, batch, replay)})
    per_token = int(np.prod(batch.expert_ids.shape[2:])) * batch.expert_ids.itemsize
    print(f"tiny_moe bf16, {args.prompts} prompts, {rows[0]['tokens']} sampled tokens, record {per_token} bytes a "
          "token")
    print(f"{'lag':>3} {'replay':>6} {'mean|dlp|':>10} {'max|dlp|':>9} {'tok-layers rerouted':>20}"
          f" {'tokens rerouted':>16}")
    for r in rows:
        print(f"{r['lag']:>3} {str(r['replay']):>6} {r['mean_abs_logprob_diff']:>10.4f}"
              f" {r['max_abs_logprob_diff']:>9.4f} {r['token_layers_routed_differently']:>20.3%}"
              f" {r['tokens_routed_differently']:>16.3%}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "bytes_per_token": per_token, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
