"""`launch.py submit [--address URL] [--wait] [--python PY] [--agent-wait-s S] [--config-name NAME] [overrides]` and
`launch.py status|logs|stop JOB_ID [--address URL]`: the run as a Ray Job on a running cluster
(`asyncrl/orchestration/submit.py`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from asyncrl.config.loader import load_config, split_config_name
from asyncrl.orchestration import submit as jobs
from asyncrl.validate import ConfigError


def main(command: str, argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"launch.py {command}")
    ap.add_argument("--address", default=None, help="Ray dashboard/Jobs address (default: $RAY_ADDRESS)")
    if command == "submit":
        ap.add_argument("--wait", action="store_true", help="block until the job ends; exit non-zero if it failed")
        ap.add_argument("--python", default=None, help="interpreter on the head node (default: python)")
        ap.add_argument("--agent-wait-s", type=float, default=jobs.AGENT_WAIT_S,
                        help="how long to wait for a just-started head's job agent (default: %(default)ss)")
        args, rest = ap.parse_known_args(list(argv))
        from asyncrl.orchestration.plugins import import_environments

        try:
            cfg = load_config(*split_config_name(rest))  # validate here, not minutes later on the cluster
            # The user's environment and agent packages travel with the job.
            py_modules = import_environments(cfg.task, cfg.agent.fn)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        if args.agent_wait_s < 0:
            print(f"error: --agent-wait-s must be >= 0, got {args.agent_wait_s}", file=sys.stderr)
            return 2
        return jobs.submit(args.address, rest, args.python, args.wait, args.agent_wait_s, py_modules)
    ap.add_argument("job_id")
    args = ap.parse_args(list(argv))
    return getattr(jobs, command)(args.address, args.job_id)
