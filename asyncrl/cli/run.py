"""`launch.py [--config-name NAME] [key=value | group=option ...]`: the RL run, on a local Ray cluster of simulated
hosts, or on the cluster at RAY_ADDRESS."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncrl.config.loader import load_config, split_config_name, to_yaml
from asyncrl.validate import ConfigError


def main(argv: Sequence[str]) -> int:
    from asyncrl.orchestration.plugins import import_environments

    try:
        cfg = load_config(*split_config_name(argv))
        import_environments(cfg.task, cfg.agent.fn)  # a bad environment or agent fails now, naming its key
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from asyncrl.orchestration.driver import run

    return run(cfg.driver_config(), to_yaml(cfg))
