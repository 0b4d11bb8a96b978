"""Fault injection for chaos tests: a host SIGKILLs itself (or hangs) at a named point of the loop.

Some faults cannot be aimed from outside: a kill that must land *inside* a weight sync, or a hang that the
driver's stall detector must catch. `ASYNCRL_FAULTS` names them, `;`-separated, each `action@point:rank:step`:

    ASYNCRL_FAULTS="kill@weight_sync:1:7;hang@step:0:3"

`kill` SIGKILLs the process (no cleanup, like a lost VM); `hang` sleeps forever. Points: `step` (a trainer host
starting step N), `weight_sync` (a host entering the sync that follows step N; the initial sync is step 0),
`startup` (a host joining jax.distributed; step 0). And one lasting fault: `slow@decode:RANK:MS` makes inference
host RANK sleep MS milliseconds after every decode chunk of each replica, a slow host for the whole run
(`slowdown`).
Inference hosts count syncs by the version they receive. Each fault fires once per run directory (a marker file
records it), so a restarted host does not die again at the same place. Unset in normal runs: `point` is then a
dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)

ENV = "ASYNCRL_FAULTS"


def parse(spec: str) -> list[tuple[str, str, int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            action, rest = part.split("@")
            point, rank, step = rest.split(":")
            ok = (action in ("kill", "hang") and point in ("step", "weight_sync", "startup")
                  or action == "slow" and point == "decode")
            if not ok:
                raise ValueError
            out.append((action, point, int(rank), int(step)))
        except ValueError:
            raise ValueError(f"{ENV}: bad fault {part!r}; expected kill|hang@step|weight_sync|startup:rank:step or "
                             "slow@decode:rank:milliseconds") from None
    return out


def slowdown(rank: int) -> float:
    """Seconds inference host `rank` sleeps after each decode chunk (`slow@decode`); 0 in normal runs."""
    spec = os.environ.get(ENV)
    if not spec:
        return 0.0
    return sum(ms / 1000 for action, where, r, ms in parse(spec) if action == "slow" and r == rank)


def point(name: str, rank: int, step: int, run_dir: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    for action, where, r, s in parse(spec):
        if action == "slow" or (where, r, s) != (name, rank, step):
            continue
        marker = os.path.join(run_dir, f".fault-{action}-{where}-{r}-{s}")
        if os.path.exists(marker):
            continue
        open(marker, "w").close()
        log.warning("fault injection: %s at %s (rank %d, step %d)", action, where, rank, step)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)
