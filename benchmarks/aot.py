"""Compile the TPU presets' programs on this machine (`launch.py aot`) and tabulate them.

Each case runs `python launch.py aot --config-name NAME [overrides] --out ...` in its own process (libtpu,
compiled for the preset's slice: nothing runs on a TPU). The baseline of every row is its ideal, computed in the
same run: 6·N·tokens of compute for the train step, the weights plus the whole KV cache for a decode step. The
`ratio` column is ideal / compiled roofline (the MFU ceiling for training, the traffic ratio for decode).

    PYTHONPATH=. .venv/bin/python benchmarks/aot.py                    # every case: ~40 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/aot.py --cases qwen3-8b   # a subset (names below)

Writes benchmarks/results/aot.json (merged with what is already there, so cases can be run one at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "aot.json")

# name -> (config name, overrides, programs or None for all)
CASES = {
    "qwen3-1.7b": ("v5p64_qwen3_1.7b", [], None),
    "qwen3-4b": ("v5p64_qwen3_4b", [], None),
    "qwen3-8b": ("v5p64_qwen3_8b", [], None),
    "llama3.1-8b": ("v5p64_llama3.1_8b", [], None),
    "v6e8-qwen3-1.7b": ("v6e8_qwen3_1.7b", [], None),
    # Its train step with the matmul outputs saved (the preset's remat policy before it became 'full').
    "v6e8-qwen3-1.7b-dots": ("v6e8_qwen3_1.7b", ["train.remat_policy=dots"], "train_step"),
    # Decode with tensor parallelism: Qwen3-8B, tp=4, 44 rows.
    "qwen3-8b-decode-tp4": ("v5p64_qwen3_8b", ["inference.tp=4", "inference.max_decode_batch_size=44"], "decode"),
    # Weak scaling: the same per-chip work (4 sequences of 4096, grad-accum 4) on 32 trainer chips of a v5p-128.
    "qwen3-8b-train-32chips": ("v5p64_qwen3_8b", ["run.tpu_topology=v5p:4x4x4", "run.hosts=16", "async.train_workers=8",
                                                  "train.train_batch_size=128"], "train_step"),
    # Qwen3-8B without remat: it did not fit before the flash-attention kernel (192.75 GiB) and now does.
    "qwen3-8b-no-remat": ("v5p64_qwen3_8b", ["train.remat=false"], "train_step"),
    # ... and without grad accumulation too, 4 sequences of 4096 at once: does not fit (exit 1), the case of the
    # out-of-memory report (program, shortfall, largest buffers) that README.md shows.
    "qwen3-8b-no-remat-ga1": ("v5p64_qwen3_8b", ["train.remat=false", "train.grad_accum_steps=1"], "train_step"),
    # FSDP over 8 chips x dp=2 instead of over all 16: the layer gradients are reduce-scattered in groups of 8 (a
    # 16-chip group on this slice is lowered by the TPU compiler as an all-reduce and a slice, even from an explicit
    # psum_scatter).
    "qwen3-8b-dp2-fsdp8": ("v5p64_qwen3_8b", ["sharding.mesh.dp=2", "sharding.mesh.fsdp=8"], "train_step"),
    # What Ulysses context parallelism buys at long context: Qwen3-8B at 16k tokens, 16 trainer chips.
    "qwen3-8b-16k-cp1": ("v5p64_qwen3_8b", ["inference.max_seq_len=16384", "train.train_batch_size=32",
                                            "train.grad_accum_steps=2", "sharding.mesh.cp_ulysses=1"], "train_step"),
    "qwen3-8b-16k-cp4": ("v5p64_qwen3_8b", ["inference.max_seq_len=16384", "train.train_batch_size=32",
                                            "train.grad_accum_steps=2", "sharding.mesh.cp_ulysses=4"], "train_step"),
    # The LM head at one bf16 pass (model.logits_precision=default) instead of HIGH's three: the MFU ceiling each
    # precision allows (issue #39); the preset rows above are at 'high'.
    "qwen3-8b-logits-default": ("v5p64_qwen3_8b", ["model.logits_precision=default"], "train_step"),
    "v6e8-qwen3-1.7b-logits-default": ("v6e8_qwen3_1.7b", ["model.logits_precision=default"], "train_step"),
}


def run_case(name: str) -> dict:
    config, overrides, programs = CASES[name]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "launch.py", "aot", "--config-name", config, "--out", path, *overrides]
    if programs:
        cmd += ["--programs", programs]
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    rows = []
    if os.path.getsize(path):
        with open(path) as f:
            rows = json.load(f)
    os.unlink(path)
    if proc.returncode not in (0, 1) or not rows:
        raise RuntimeError(f"{name}: launch.py aot exited {proc.returncode}\n{proc.stderr[-4000:]}")
    failures = [line for line in proc.stderr.splitlines() if "does not fit" in line]
    return {"config": config, "overrides": overrides, "exit_code": proc.returncode, "wall_s": time.time() - t0,
            "failures": failures, "rows": rows}


def table(results: dict) -> str:
    head = ("case", "program", "chips", "peak GiB", "fits", "TFLOP", "HBM GB", "roofline ms", "ideal ms", "ratio",
            "all-gather GB", "all-reduce GB", "reduce-scatter GB", "all-to-all GB")
    lines = []
    for case, res in results.items():
        for r in res["rows"]:
            c = r.get("collective_bytes", {})
            ok = r["error"] is None
            lines.append((case, r["program"], str(r["chips"]), f"{r['peak_bytes_per_chip'] / 2**30:.2f}",
                          "yes" if r["fits"] else "NO",
                          f"{r['flops'] / 1e12:.2f}" if ok else "-",
                          f"{r['hbm_bytes_accessed'] / 1e9:.2f}" if ok else "-",
                          f"{r['roofline_s'] * 1e3:.1f}" if ok else "-", f"{r['ideal_s'] * 1e3:.1f}" if ok else "-",
                          f"{r['ratio']:.2f}" if ok else "-",
                          *(f"{c.get(k, 0) / 1e9:.2f}" for k in ("all-gather", "all-reduce", "reduce-scatter",
                                                                 "all-to-all"))))
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(x) for x in lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--jobs", type=int, default=1, help="cases compiled at once (XLA compiles mostly on one core)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.jobs) as pool:
        for name, res in zip(args.cases, pool.map(run_case, args.cases)):
            print(f"== {name}: {res['wall_s']:.0f}s", file=sys.stderr, flush=True)
            for line in res["failures"]:
                print(f"   {line}", file=sys.stderr)
            results[name] = res
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    ordered = {k: results[k] for k in CASES if k in results}
    print(table(ordered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
