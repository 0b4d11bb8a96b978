"""Router replay on the tiny MoE in bf16: how far the trainer's teacher-forced logprobs sit from the sampler's, and
what share of tokens it routes differently, with the sampler `--lag` optimizer steps behind (max_lag 2), with and
without replaying the sampler's routing (`Model.apply_routed`, `get_logprobs(expert_ids=...)`).

The sampler decodes as the engine does (prefill, then one fed token a step with a KV cache, bf16 weights and cache)
and records each fed model token's experts at every MoE layer (int8, Lm x k bytes a token). The lagged trainer's
weights are the sampler's after `--lag` sign-of-gradient steps (Adam's first steps) of lr `--lr` on a GRPO-like
objective (the sampled completions' logprobs times random +-1 advantages). Lag 0 is the same weights: what bf16
numerics alone (cached decode against one full forward) do to the routing.

    python benchmarks/router_replay.py [--prompts 16] [--tokens 48] [--lag 2] [--lr 1e-3]

Prints a table; writes benchmarks/results/router_replay.json.
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

from asyncrl.models import Model, params as params_lib, preset  # noqa: E402


def sample(model, params, prompts, n, key):
    """[B, P] prompts -> tokens [B, n], sampler logprobs [B, n] (f32 of bf16 logits), routing record [B, P+n, Lm, k]
    int8 (-1 at prompt positions and the never-fed last token)."""
    B, P = prompts.shape
    cfg = model.cfg
    cache = model.init_kv_cache(B, P + n + 1, jnp.bfloat16)
    prefill = jax.jit(lambda p, x, c: model.prefill(p, x, jnp.full((B,), P - 1), c))
    step = jax.jit(lambda p, x, c: model.apply_routed(p, x, jnp.ones((B,), jnp.int32), c))
    _, cache = prefill(params, prompts[:, :-1], cache)
    record = np.full((B, P + n, len(cfg.sparse_layers), cfg.num_experts_per_tok), -1, np.int8)
    fed, toks, lps = prompts[:, -1], [], []
    for j in range(n):
        logits, cache, ids = step(params, fed[:, None], cache)
        if j >= 1:
            record[:, P - 1 + j] = np.asarray(ids[:, 0])
        lp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32))
        tok = jax.random.categorical(jax.random.fold_in(key, j), lp)
        toks.append(tok)
        lps.append(jnp.take_along_axis(lp, tok[:, None], 1)[:, 0])
        fed = tok
    return np.stack(toks, 1), np.stack(lps, 1), record


def lagged(model, params, full, lr, lag, key):
    """`lag` sign-of-gradient steps on sum(logprob * advantage), advantages +-1 per sequence."""
    n = jnp.full((full.shape[0],), full.shape[1])
    for i in range(lag):
        adv = jnp.sign(jax.random.normal(jax.random.fold_in(key, i), (full.shape[0], 1)))
        g = jax.grad(lambda p: jnp.sum(model.get_logprobs(p, full, n) * adv))(params)
        params = jax.tree.map(lambda w, d: (w.astype(jnp.float32) + lr * jnp.sign(d)).astype(w.dtype), params, g)
    return params


def measure(model, params, full, P, lps, record, replay):
    n = jnp.full((full.shape[0],), full.shape[1])
    ids_in = jnp.asarray(record) if replay else None
    lp = np.asarray(model.get_logprobs(params, full, n, expert_ids=ids_in))[:, P - 1:]
    _, _, used = model.apply_routed(params, full, n, apply_lm_head=False, expert_ids=ids_in)
    model_tok = slice(P, full.shape[1] - 1)  # the fed model tokens (the record's non-prompt rows)
    got, want = np.sort(np.asarray(used)[:, model_tok], -1), np.sort(record[:, model_tok], -1)
    return {"mean_abs_logprob_diff": float(np.mean(np.abs(lp - lps))),
            "max_abs_logprob_diff": float(np.max(np.abs(lp - lps))),
            "token_layers_routed_differently": float(np.mean(np.any(got != want, -1))),
            "tokens_routed_differently": float(np.mean(np.any(got != want, (-1, -2))))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--lag", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "router_replay.json"))
    args = ap.parse_args()
    model = Model(preset("tiny_moe"))
    key = jax.random.PRNGKey(args.seed)
    params = params_lib.cast(model.init_params(key), jnp.bfloat16)
    prompts = jax.random.randint(jax.random.fold_in(key, 1), (args.prompts, args.prompt_len), 3,
                                 model.cfg.vocab_size)
    toks, lps, record = sample(model, params, prompts, args.tokens, jax.random.fold_in(key, 2))
    full = jnp.concatenate([prompts, jnp.asarray(toks)], 1)
    rows = []
    for lag in sorted({0, args.lag}):
        trainer = lagged(model, params, full, args.lr, lag, jax.random.fold_in(key, 3))
        for replay in (False, True):
            r = measure(model, trainer, full, args.prompt_len, lps, record, replay)
            rows.append({"lag": lag, "replay": replay, **r})
    print(f"tiny_moe bf16, {args.prompts} x {args.tokens} sampled tokens, record {record[0, 0].size} bytes a token")
    print(f"{'lag':>3} {'replay':>6} {'mean|dlp|':>10} {'max|dlp|':>9} {'tok-layers rerouted':>20}"
          f" {'tokens rerouted':>16}")
    for r in rows:
        print(f"{r['lag']:>3} {str(r['replay']):>6} {r['mean_abs_logprob_diff']:>10.4f}"
              f" {r['max_abs_logprob_diff']:>9.4f} {r['token_layers_routed_differently']:>20.3%}"
              f" {r['tokens_routed_differently']:>16.3%}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "bytes_per_token": int(record[0, 0].size), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
