"""The matmuls of one SmolLM2-135M decode step on this CPU, alone, with every kernel at hand.

A decode step at batch B multiplies B rows by each of the 30 layers' seven projection matrices and by the tied
[49152, 576] LM head: 2 x 135M x B FLOPs. This times exactly those products, fp32, with no attention, norms or
engine around them, four ways:
- `xla x@W`: XLA:CPU, [B, K] x [K, N], the layout of the model's einsums (the engine before output-major weights);
- `xla W^T x^T`: XLA:CPU, [N, K] x [K, B] with the optimization barrier of `models/dense.py` (the engine now);
- `numpy`: numpy's BLAS, [B, K] x [K, N];
- `torch`: torch's CPU matmul (what transformers' decode runs), [B, K] x [K, N], torch.no_grad.
Their sum is a floor under any decode step built on that kernel. The baseline in the same run is numpy's rate on a
2048^2 matmul, the figure the decode benchmark's FLOP roof uses.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_matmul.py [--batches 1 16] [--repeats 20]

Writes `benchmarks/results/cpu_matmul.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_matmul.json")
L, D, F, HD, KD, V = 30, 576, 1536, 9 * 64, 3 * 64, 49152  # SmolLM2-135M: layers, width, MLP, q / kv widths, vocab
SHAPES = [(D, HD), (D, KD), (D, KD), (HD, D), (D, F), (D, F), (F, D)]  # per layer [K, N]: q k v o gate up down


def best(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((k, n), dtype=np.float32) * 0.02 for _ in range(L) for k, n in SHAPES]
    ws.append(rng.standard_normal((D, V), dtype=np.float32) * 0.02)  # the LM head as [K, N]
    flops_per_row = 2 * sum(w.size for w in ws)
    w_j = [jnp.asarray(w) for w in ws]
    wt_j = [jnp.asarray(np.ascontiguousarray(w.T)) for w in ws]
    w_t = [torch.from_numpy(w) for w in ws]
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    peak = 2 * 2048**3 / best(lambda: a @ a, 5)

    # Each product reads the same input rows: the step's data dependencies are not what is timed here.
    row_major = jax.jit(lambda ws, x: [x[:, : w.shape[0]] @ w for w in ws])
    output_major = jax.jit(lambda wts, x: [jax.lax.optimization_barrier(wt @ x[:, : wt.shape[1]].T).T for wt in wts])
    rows = []
    for b in args.batches:
        x = rng.standard_normal((b, F), dtype=np.float32)
        xj, xt = jnp.asarray(x), torch.from_numpy(x)
        with torch.no_grad():
            t = {
                "xla x@W": best(lambda: jax.block_until_ready(row_major(w_j, xj)), args.repeats),
                "xla W^T x^T": best(lambda: jax.block_until_ready(output_major(wt_j, xj)), args.repeats),
                "numpy": best(lambda: [x[:, : w.shape[0]] @ w for w in ws], args.repeats),
                "torch": best(lambda: [xt[:, : w.shape[0]] @ w for w in w_t], args.repeats),
            }
        for kernel, s in t.items():
            rows.append({"batch": b, "kernel": kernel, "ms": 1e3 * s, "gflops": flops_per_row * b / s / 1e9,
                         "share_of_peak": flops_per_row * b / s / peak})
    print(f"SmolLM2-135M decode-step matmuls alone (30 layers x 7 + LM head, fp32, {os.cpu_count()} cores); "
          f"numpy 2048^2 matmul {peak / 1e9:.0f} GFLOP/s; load average {os.getloadavg()[0]:.2f}")
    print(f"{'B':>3}  {'kernel':<12} {'ms':>8} {'GFLOP/s':>8} {'of peak':>8}")
    for r in rows:
        print(f"{r['batch']:>3}  {r['kernel']:<12} {r['ms']:>8.2f} {r['gflops']:>8.1f} {r['share_of_peak']:>7.1%}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"peak_flops": peak, "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
