"""asyncrl launcher: a thin Ray driver. The logic lives in asyncrl/orchestration.

    python launch.py [--config-name NAME] [key=value | group=option ...]   run (local Ray cluster, or RAY_ADDRESS)
    python launch.py submit [--address URL] [--wait] [--config-name NAME] [overrides]   submit as a Ray Job
    python launch.py status JOB_ID | logs JOB_ID | stop JOB_ID [--address URL]
    python launch.py roofline --model llama-3.1-8b --chip v5p --chips 32 ...        pick the train/inference split
    python launch.py aot [--config-name NAME] [overrides] [--topology v5p:2x4x4] [--json]   compile for a TPU slice
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    if argv and argv[0] == "aot":
        from asyncrl.aot.report import main as aot

        return aot(argv[1:])
    if argv and argv[0] == "roofline":
        from asyncrl.aot.roofline_cli import main as roofline

        return roofline(argv[1:])
    if argv and argv[0] in ("submit", "status", "logs", "stop"):
        from asyncrl.orchestration import submit as jobs

        ap = argparse.ArgumentParser(prog=f"launch.py {argv[0]}")
        ap.add_argument("--address", default=None, help="Ray dashboard/Jobs address (default: $RAY_ADDRESS)")
        if argv[0] == "submit":
            ap.add_argument("--wait", action="store_true", help="block until the job ends; exit non-zero if it failed")
            ap.add_argument("--python", default=None, help="interpreter on the head node (default: python)")
            args, rest = ap.parse_known_args(argv[1:])
            from asyncrl.config.loader import load_config

            load_config(*_split_name(rest))  # validate here, not minutes later on the cluster
            return jobs.submit(args.address, rest, args.python, args.wait)
        ap.add_argument("job_id")
        args = ap.parse_args(argv[1:])
        return getattr(jobs, argv[0])(args.address, args.job_id)
    from asyncrl.config.loader import load_config
    from asyncrl.config.validate import ConfigError

    try:
        cfg = load_config(*_split_name(argv))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from asyncrl.orchestration.driver import run

    return run(cfg)


def _split_name(argv: list[str]) -> tuple[str, list[str]]:
    name, rest, i = "default", [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config-name":
            name = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config-name="):
            name = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return name, rest


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
