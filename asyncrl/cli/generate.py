"""Offline generation with the inference engine alone: evaluate a checkpoint, or debug the engine.

    python -m asyncrl.generate --model DIR --prompts IN.jsonl --out OUT.jsonl [--temperature T]
        [--max-new-tokens N] [--n K] [--seed S] [--chat] [--max-decode-batch-size B]

Input rows are {"prompt": str} or {"tokens": [int]} (other keys are kept). Output rows, in input order, add
"tokens" (generated ids only, with a sampled EOS; the EOS forced at the length limit is left out), "text" and
"logprobs"; with --n K > 1 these are lists of K. A bad input row is reported on stderr with its line number and
written as {"line": n, "error": ...} so no other row is lost; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Row:
    line: int
    data: dict | None
    tokens: list[int] | None
    error: str | None = None


def read_rows(path: str, tokenizer: Any, chat: bool) -> list[Row]:
    rows: list[Row] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError("row is not a JSON object")
                if "tokens" in data:
                    toks = data["tokens"]
                    if not isinstance(toks, list) or not toks or not all(isinstance(t, int) and t >= 0 for t in toks):
                        raise ValueError("'tokens' must be a non-empty list of non-negative ints")
                elif "prompt" in data:
                    prompt = data["prompt"]
                    if not isinstance(prompt, (str, list)):
                        raise ValueError("'prompt' must be a string or a list of chat messages")
                    if tokenizer is None:
                        raise ValueError("'prompt' rows need a tokenizer in the model folder")
                    toks = tokenizer.encode_prompt(prompt, chat=chat)
                else:
                    raise ValueError("row has neither 'prompt' nor 'tokens'")
                rows.append(Row(n, data, [int(t) for t in toks]))
            except (ValueError, TypeError, json.JSONDecodeError) as e:
                rows.append(Row(n, None, None, f"{path}:{n}: {e}"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (config.json + safetensors [+ tokenizer])")
    ap.add_argument("--prompts", required=True, help="input JSONL")
    ap.add_argument("--out", required=True, help="output JSONL")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    ap.add_argument("--max-decode-batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import jax
    from tqdm import tqdm

    from asyncrl.inference.config import InferenceConfig
    from asyncrl.inference.engine import Request
    from asyncrl.inference.replicas import ReplicaSet
    from asyncrl.models import from_pretrained
    from asyncrl.models.tokenizer import Tokenizer
    from asyncrl.rollout import Prompt

    tokenizer = None
    if any(os.path.isfile(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = Tokenizer.from_folder(args.model)
    model, params = from_pretrained(args.model, dtype=args.dtype)
    rows = read_rows(args.prompts, tokenizer, args.chat)
    good = [r for r in rows if r.error is None]
    for r in rows:
        if r.error:
            print(f"bad row: {r.error}", file=sys.stderr)
    if tokenizer is not None:
        eos = tokenizer.eos_id
    else:
        eos = model.cfg.eos_token_ids[0] if model.cfg.eos_token_ids else None
    if eos is None:
        print("error: no EOS id: the model folder has no tokenizer and config.json no eos_token_id", file=sys.stderr)
        return 2
    longest = max((len(r.tokens) for r in good), default=1)  # type: ignore[arg-type]
    max_seq_len = -(-(longest + args.max_new_tokens + 1) // 8) * 8
    cfg = InferenceConfig(
        group_size=args.n, max_decode_batch_size=args.max_decode_batch_size, max_prefill_prompts=8,
        max_seq_len=max_seq_len, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        params_dtype=args.dtype, kv_cache_dtype=args.dtype,
    )
    replicas = ReplicaSet(model, params, cfg, tokenizer, devices=jax.local_devices(), seed=args.seed, eos_id=eos)
    bar = tqdm(total=len(good), desc="generate", unit="prompt", file=sys.stderr)
    rollouts = replicas.generate([Request(Prompt(i, r.line, args.n), r.tokens) for i, r in enumerate(good)],
                                 on_group=lambda _: bar.update(1))
    bar.close()
    by_line = {ro.prompt.sample: ro for ro in rollouts}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            if r.error is not None:
                f.write(json.dumps({"line": r.line, "error": r.error}) + "\n")
                continue
            ro = by_line[r.line]
            outs = []
            for c in ro.completions:
                keep = ~(c.forced & (c.tokens == eos))  # the length-limit EOS was not generated by the model
                toks = c.tokens[keep]
                outs.append({"tokens": toks.tolist(), "text": tokenizer.decode(toks) if tokenizer else "",
                             "logprobs": np.round(c.logprobs[keep], 6).tolist(), "finish_reason": c.finish_reason})
            out = dict(r.data or {})
            if args.n == 1:
                out.update(outs[0])
            else:
                out.update({k: [o[k] for o in outs] for k in ("tokens", "text", "logprobs", "finish_reason")})
            f.write(json.dumps(out) + "\n")
    os.replace(tmp, args.out)
    n_bad = sum(r.error is not None for r in rows)
    print(f"wrote {len(rows)} rows to {args.out} ({n_bad} bad)", file=sys.stderr)
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
