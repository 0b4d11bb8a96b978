"""How many cores a busy replica's decode uses at each decode batch size (issue #39, the planner's halved batch).

The planner's core-sharing model (`asyncrl/plan/cores.py`) has every busy process ask for the whole machine,
whatever its batch. Its one systematic miss left is the halved decode batch, predicted 11-24% too slow in all
three quiet sets (`benchmarks/README.md`, plan section): a batch-16 run steps faster than batch 32. One
explanation would be a smaller decode using fewer cores, leaving the trainer more. This measures it: the local
default's model and inference settings (format warm-start off, as `plan_validate.py --cross` runs them; random
weights of its shapes), one engine per batch size on this machine, busy as in a run (4 x B prompts decoded to the
end of their context, never stopping early), and the process's CPU seconds over wall seconds while it decodes.
Batch 32, the preset's, is the baseline of the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_cores.py [--batches 16 32 64] [--seconds 4]

Writes benchmarks/results/decode_cores.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from dataclasses import replace

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.machine import describe, machine  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--baseline", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0, help="decode time per batch size (after its compile)")
    ap.add_argument("--out", default=str(HERE / "results" / "decode_cores.json"))
    args = ap.parse_args(argv)
    mach = machine()
    print(describe(mach))

    import jax
    import numpy as np

    from asyncrl.config.loader import load_config
    from asyncrl.inference.engine import Engine, Request
    from asyncrl.models import Model
    from asyncrl.models.sources import model_config
    from asyncrl.rollout import Prompt

    cfg = load_config("default", ["train.format_warmstart_steps=0"])
    inf = cfg.inference
    prompt_len = max(1, inf.max_seq_len // 2)
    model = Model(model_config(cfg.model))
    params = model.init_params(jax.random.PRNGKey(0), jax.numpy.dtype(inf.params_dtype))
    eos = model.cfg.vocab_size  # never sampled: every row decodes to the end of its context
    rng = np.random.default_rng(0)
    rows = {}
    for b in sorted(set(args.batches) | {args.baseline}):
        eng = Engine(model, params, replace(inf, max_decode_batch_size=b,
                                            max_new_tokens=inf.max_seq_len - prompt_len - 1,
                                            max_prefill_prompts=min(inf.max_prefill_prompts, b)), None, eos_id=eos)
        prompts = [rng.integers(3, model.cfg.vocab_size - 1, size=prompt_len).tolist() for _ in range(4 * b)]

        def decode() -> None:
            eng.generate([Request(Prompt(i), p) for i, p in enumerate(prompts)], drain=True)  # noqa: B023

        decode()  # compiles
        cpu0, wall0 = time.process_time(), time.perf_counter()
        dec0, steps0, passes = eng.stats.decode_time, eng.stats.decode_steps, 0
        while passes < 2 or time.perf_counter() - wall0 < args.seconds:
            decode()
            passes += 1
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        steps = eng.stats.decode_steps - steps0
        rows[b] = {"decode_ms_per_step": 1e3 * (eng.stats.decode_time - dec0) / steps,
                   "wall_ms_per_step": 1e3 * wall / steps, "cores_used": cpu / wall,
                   "tokens_per_s": b * steps / wall, "passes": passes, "steps": steps}
    base = rows[args.baseline]
    print(f"\ndecode, the local default's model (random weights), "
          f"max_seq_len {inf.max_seq_len}, prompts of {prompt_len} tokens; baseline batch {args.baseline}")
    print(f"{'batch':>5} {'decode ms/step':>15} {'wall ms/step':>13} {'cores used':>11} {'tokens/s':>9} "
          f"{'step vs base':>13} {'cores vs base':>14}")
    for b, r in rows.items():
        print(f"{b:>5} {r['decode_ms_per_step']:>15.3f} {r['wall_ms_per_step']:>13.3f} {r['cores_used']:>11.2f} "
              f"{r['tokens_per_s']:>9.0f} {r['wall_ms_per_step'] / base['wall_ms_per_step']:>13.2f} "
              f"{r['cores_used'] / base['cores_used']:>14.2f}")
    pathlib.Path(args.out).write_text(json.dumps({"machine": mach, "max_seq_len": inf.max_seq_len,
                                                  "prompt_len": prompt_len, "baseline": args.baseline,
                                                  "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
