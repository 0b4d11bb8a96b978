"""`launch.py aot`: compile a run's programs for a TPU slice on any machine, and say whether they fit and how fast
they can be (the report itself: `asyncrl/aot/report.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from asyncrl.aot.programs import ProgramsConfig
from asyncrl.aot.report import AotError, failure_message, format_table, json_rows, run_aot, without_persistent_cache
from asyncrl.config.loader import load_config, split_config_name
from asyncrl.config.schema import Config
from asyncrl.validate import ConfigError


def programs_config(cfg: Config) -> ProgramsConfig:
    """The sections of the run config its programs are built from. Split here, where both are seen: `aot/` sits
    below `config/` (it may not import it), and `config/` below `aot/`'s users."""
    return ProgramsConfig(model=cfg.model, inference=cfg.inference, train=cfg.train, loss=cfg.loss,
                          sharding=cfg.sharding, train_workers=cfg.async_.train_workers, hosts=cfg.run.hosts)


def main(argv: Sequence[str]) -> int:
    """`launch.py aot [--config-name NAME] [overrides] [--topology T] [--json] [--out FILE] [--programs P,Q]`"""
    ap = argparse.ArgumentParser(prog="launch.py aot", description=__doc__.split("(")[0].strip())
    ap.add_argument("--topology", default=None, help="TPU slice, e.g. v5p:2x4x4 (default: the config's "
                    "run.tpu_topology); a GPU is refused, saying why")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    ap.add_argument("--out", default=None, help="also write the JSON rows to this file")
    ap.add_argument("--programs", default=None,
                    help="comma-separated: only programs whose name starts with one of these (e.g. train_step,decode)")
    args, rest = ap.parse_known_args(list(argv))
    without_persistent_cache()
    try:
        cfg = load_config(*split_config_name(rest))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    topology = args.topology or cfg.run.tpu_topology
    if topology is None:
        gpu = " (run.platform is gpu: aot compiles for TPU slices only; see --topology)" \
            if cfg.run.platform == "gpu" else ""
        print(f"launch.py aot: no --topology and the config sets no run.tpu_topology{gpu}", file=sys.stderr)
        return 2
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        only = [p for p in args.programs.split(",") if p] if args.programs else None
        rows = run_aot(programs_config(cfg), topology, only, progress)
    except (AotError, ValueError) as e:
        print(f"launch.py aot: {e}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(json_rows(rows), f, indent=1)
    if args.json:
        print(json.dumps(json_rows(rows), indent=1))
    else:
        print(f"{cfg.run.name} on {topology}: memory per chip (binary units); FLOPs, HBM bytes and collective bytes "
              "per chip and per call, loops weighted by trip count")
        print(format_table(rows))
    bad = [r for r in rows if not r.fits]
    for r in bad:
        print(failure_message(r), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
