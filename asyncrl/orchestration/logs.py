"""The run's logging, the same on the driver and every host: `logging.level` for asyncrl's own lines (per-sync and
per-checkpoint lines are DEBUG, so INFO leaves the progress bar alone), third-party per-call chatter held at
WARNING, and warnings and errors always printed. `logging.level=DEBUG` brings everything back, the chatter too."""

from __future__ import annotations

import logging

CHATTY = ("absl", "jax._src.distributed", "orbax", "matplotlib", "PIL")  # per-call or per-font lines at INFO/DEBUG


def configure(level: str, fmt: str) -> None:
    logging.basicConfig(level=getattr(logging, level), format=fmt)
    logging.getLogger().setLevel(getattr(logging, level))  # also when a handler was already installed
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if level == "DEBUG" else logging.WARNING)
