"""The commands, in one place: `launch.py <command>` dispatches here, and `python -m asyncrl.generate` /
`asyncrl.evaluate` keep working through their shims.

    run (default)   the RL run: a local Ray cluster of simulated hosts, or the cluster at RAY_ADDRESS
    submit          the run as a Ray Job; status | logs | stop JOB_ID follow it
    aot             compile every program of a run for a TPU slice (fit, roofline)
    roofline        the blog's closed-form trainer / inference split
    plan            a discrete-event model of the pipeline: replay a finished run, ask what if
    generate        offline generation with the inference engine
    evaluate        a checkpoint's held-out reward and pass@k
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

# command -> module under asyncrl.cli with a `main(argv) -> int`
COMMANDS = {
    "run": "run", "submit": "jobs", "status": "jobs", "logs": "jobs", "stop": "jobs",
    "aot": "aot", "roofline": "roofline", "plan": "plan", "generate": "generate", "evaluate": "evaluate",
}


def main(argv: Sequence[str]) -> int:
    """`launch.py [COMMAND] [args]`: a first argument that is not a command is the run's (an override or a flag)."""
    argv = list(argv)
    if argv and argv[0] in COMMANDS:
        command, rest = argv[0], argv[1:]
    else:
        command, rest = "run", argv
    module = importlib.import_module(f"asyncrl.cli.{COMMANDS[command]}")
    if COMMANDS[command] == "jobs":
        return module.main(command, rest)
    return module.main(rest)
