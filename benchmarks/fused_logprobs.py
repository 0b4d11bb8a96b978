"""Compiled temporary memory of the fused chunked logprobs vs the naive log_softmax(h @ W), forward and
forward+backward (grad w.r.t. h and W), at a Qwen-sized LM head.

Only compiles (inputs are ShapeDtypeStructs), so it runs anywhere in seconds; `--time` also runs both programs
on the default backend with random inputs, which is only sensible on an accelerator.

    python benchmarks/fused_logprobs.py [--tokens 16384 --hidden 1024 --vocab 151936 --chunk-sizes 1024] [--time]

Writes benchmarks/results/fused_logprobs.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from asyncrl.ops.logprobs import fused_linear_selection

MiB = 2**20
RESULTS = pathlib.Path(__file__).parent / "results" / "fused_logprobs.json"


def naive(h: jax.Array, W: jax.Array, targets: jax.Array) -> jax.Array:
    logits = h.astype(jnp.float32) @ W.astype(jnp.float32)  # [N, V]
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)[:, 0]


def programs(f: Callable) -> dict[str, Callable]:
    objective = lambda h, W, t: jnp.sum(f(h, W, t))  # noqa: E731
    return {"forward": objective, "forward+backward": jax.value_and_grad(objective, argnums=(0, 1))}


def seconds_per_call(compiled, args, repeats: int = 5) -> float:
    jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="N = B * T")
    parser.add_argument("--hidden", type=int, default=1024, help="D")
    parser.add_argument("--vocab", type=int, default=151936, help="V (Qwen2/3)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of h and W")
    parser.add_argument("--time", action="store_true", help="also run each program and report seconds per call")
    args = parser.parse_args()

    dtype = jnp.dtype(args.dtype)
    shapes = (
        jax.ShapeDtypeStruct((args.tokens, args.hidden), dtype),
        jax.ShapeDtypeStruct((args.hidden, args.vocab), dtype),
        jax.ShapeDtypeStruct((args.tokens,), jnp.int32),
    )
    real = None
    if args.time:
        kh, kw, kt = jax.random.split(jax.random.key(0), 3)
        real = (
            jax.random.normal(kh, shapes[0].shape, dtype),
            (jax.random.normal(kw, shapes[1].shape, jnp.float32) * args.hidden**-0.5).astype(dtype),
            jax.random.randint(kt, shapes[2].shape, 0, args.vocab),
        )

    variants = {"naive": naive} | {
        f"fused(chunk={c})": (lambda c: lambda h, W, t: fused_linear_selection(h, W, t, c))(c) for c in args.chunk_sizes
    }
    rows = []
    for variant, f in variants.items():
        for mode, program in programs(f).items():
            compiled = jax.jit(program).lower(*shapes).compile()
            row = {"variant": variant, "mode": mode, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
            if real is not None:
                row["seconds"] = seconds_per_call(compiled, real)
            rows.append(row)
    naive_bytes = {r["mode"]: r["temp_bytes"] for r in rows if r["variant"] == "naive"}
    for r in rows:
        r["ratio_to_naive"] = r["temp_bytes"] / naive_bytes[r["mode"]]

    header = f"{'variant':<20} {'mode':<17} {'temp MiB':>10} {'/ naive':>8}" + (f" {'s/call':>8}" if args.time else "")
    print(f"N={args.tokens} D={args.hidden} V={args.vocab} {args.dtype} on {jax.default_backend()}")
    print(header)
    for r in rows:
        line = f"{r['variant']:<20} {r['mode']:<17} {r['temp_bytes'] / MiB:>10.1f} {r['ratio_to_naive']:>8.3f}"
        print(line + (f" {r['seconds']:>8.4f}" if args.time else ""))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    setup = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype}
    meta = {"backend": jax.default_backend(), "jax": jax.__version__}
    RESULTS.write_text(json.dumps({"setup": setup, "meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
