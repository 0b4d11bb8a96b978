"""`launch.py plan` at target scale for every TPU preset, and the blog's Llama-8B v5p example against its closed form.

For each `configs/v*_*.yaml` preset: compile its programs for the slice (`launch.py aot`'s train step, sync cast,
decode, prefill buckets, LoRA merge), then the plan's sweep over the trainer : inference split and max_lag. Reports
the prediction as configured, the best point, the closed-form roofline split from the same programs, and how long
the sweep took after the compile (the acceptance: under a minute). Then the batch size: the presets train 64
sequences a step, which fills few of the inference slots, so Qwen3-8B and the blog's example (Llama 3.1 8B, decode
batch 44) are also planned at 256 and 1024 sequences.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_presets.py            # compiles what aot.json lacks: ~6 min
    PYTHONPATH=. .venv/bin/python benchmarks/plan_presets.py --reuse    # the rows a previous run saved

Program times come from benchmarks/results/aot.json where it has the preset (run benchmarks/aot.py first), else
they are compiled here. Writes benchmarks/results/plan_presets.json (the rows it used go to
benchmarks/results/plan_presets_aot/).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from asyncrl.aot.report import json_rows, run_aot  # noqa: E402
from asyncrl.cli.aot import programs_config  # noqa: E402
from asyncrl.cli.plan import _AOT_PROGRAMS  # noqa: E402
from asyncrl.config.loader import load_config  # noqa: E402
from asyncrl.config.schema import Config  # noqa: E402
from asyncrl.plan.target import Assumptions, Target, closed_form_share, describe, sweep  # noqa: E402
from benchmarks.machine import describe as describe_machine, machine  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PRESETS = sorted(p.stem for p in (HERE.parent / "configs").glob("v*_*.yaml"))
# (name, preset, overrides): the batch-size cases. The Llama preset is the blog's roofline example (B_d = 44 rows
# per chip: 176 over each host's 4 chips, SPMD).
EXTRA = [(f"{preset}@{b}", preset, [f"train.train_batch_size={b}"])
         for preset in ("v5p64_qwen3_8b", "v5p64_llama3.1_8b") for b in (256, 1024)]


def _compile(cfg: Config, programs: list[str], name: str) -> list[dict]:
    t = time.perf_counter()
    rows = json_rows(run_aot(programs_config(cfg), cfg.run.tpu_topology, programs,
                             lambda m: print(f"  {m}", file=sys.stderr, flush=True)))
    print(f"  compiled {name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return rows


def rows_for(name: str, preset: str, overrides: list[str], reuse: bool) -> list[dict]:
    """The preset's compiled programs: its plain entry in results/aot.json where that has them all (the same
    programs `launch.py aot` compiles), else compiled here. A case with another decode batch recompiles decode; one
    with another train batch keeps the preset's train step, which the plan scales by tokens."""
    path = HERE / "results" / "plan_presets_aot" / f"{name}.json"
    if reuse and path.exists():
        return json.loads(path.read_text())
    aot = json.loads((HERE / "results" / "aot.json").read_text())
    plain = [e["rows"] for e in aot.values() if e.get("config") == preset and not e.get("overrides")]
    need = {"train_step", "weight_sync_cast", "decode"}
    if plain and need <= {r["program"] for r in plain[0]}:
        rows = plain[0]
    else:
        rows = _compile(load_config(preset), _AOT_PROGRAMS, preset)
    decode_overrides = [o for o in overrides if o.startswith("inference.")]
    if decode_overrides:
        (decode,) = _compile(load_config(preset, decode_overrides), ["decode"], name)
        rows = [decode if r["program"] == "decode" else r for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return rows


def plan_one(name: str, preset: str, overrides: list[str], reuse: bool, assume: Assumptions) -> dict:
    cfg = load_config(preset, overrides)
    rows = rows_for(name, preset, overrides, reuse)
    t = time.perf_counter()
    target = Target.of(cfg, rows, assume)
    points = sweep(target)
    secs = time.perf_counter() - t
    here = next(p for p in points if p.train_workers == cfg.async_.train_workers and p.max_lag == cfg.async_.max_lag)
    best = next(p for p in points if p.best)
    chips = cfg.run.hosts * cfg.run.devices_per_host
    return {"name": name, "preset": preset, "overrides": overrides, "topology": cfg.run.tpu_topology, "chips": chips,
            "sequences_per_step": cfg.train.train_batch_size,
            "inference_slots": target.replicas(cfg.async_.train_workers) * cfg.inference.max_decode_batch_size,
            "describe": describe(target), "sweep_s": secs, "as_configured": here.row(), "best": best.row(),
            "closed_form_train_share": closed_form_share(target), "points": [p.row() for p in points]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reuse", action="store_true", help="use the aot rows a previous run saved")
    ap.add_argument("--only", nargs="*", default=None, help="names to run (presets, or e.g. v5p64_qwen3_8b@1024)")
    ap.add_argument("--out", default=str(HERE / "results" / "plan_presets.json"))
    args = ap.parse_args()
    host = machine()
    assume = Assumptions()
    cases = [(p, p, []) for p in PRESETS] + EXTRA
    if args.only:
        cases = [c for c in cases if c[0] in args.only]
    out = []
    for name, preset, overrides in cases:
        print(f"{name} ...", file=sys.stderr, flush=True)
        out.append(plan_one(name, preset, overrides, args.reuse, assume))
    print(f"\nmachine: {describe_machine(host)}; efficiency {assume.efficiency}, completions log-normal mean half "
          f"the budget, spread {assume.tail}")
    head = (f"{'case':<34}{'seqs':>6}{'slots':>7}{'split':>7}{'lag':>4}{'step s':>9}{'train':>7}{'inf':>6}"
            f"{'occ':>6}{'drops':>6}{'tok/s/chip':>11} | {'best split':>10}{'lag':>4}{'step s':>9}{'tok/s/chip':>11}"
            f" | {'closed form':>11}{'sweep s':>8}")
    print(head)
    for r in out:
        a, b = r["as_configured"], r["best"]
        print(f"{r['name']:<34}{r['sequences_per_step']:>6}{r['inference_slots']:>7}"
              f"{a['trainer_chips']:>4}/{a['inference_chips']:<2}{a['max_lag']:>4}{a['step_s']:>9.2f}"
              f"{a['trainer_busy']:>7.2f}{a['inference_busy']:>6.2f}{a['decode_occupancy']:>6.2f}{a['dropped_lag']:>6}"
              f"{a['generated_tokens_per_s_per_chip']:>11.0f} | {b['trainer_chips']:>7}/{b['inference_chips']:<2}"
              f"{b['max_lag']:>4}{b['step_s']:>9.2f}{b['generated_tokens_per_s_per_chip']:>11.0f} | "
              f"{100 * r['closed_form_train_share']:>10.1f}%{r['sweep_s']:>8.1f}")
    pathlib.Path(args.out).write_text(json.dumps({"machine": host, "assumptions": assume.__dict__, "cases": out},
                                                 indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
