"""How the driver tells which host failed, and why. A run call that raised, or an actor that died, is a
HostFailure naming the host; when several hosts fail together the one that died outright is named, since its peers'
collective errors are consequences of it."""

import logging
import time
from typing import Any

import ray

from asyncrl.orchestration.host import HostResult, role_of

log = logging.getLogger("asyncrl.driver")


class HostFailure(RuntimeError):
    def __init__(self, rank: int, role: str, detail: str, traceback: str = "", died: bool = False):
        super().__init__(f"host {rank} ({role}) failed: {detail}")
        self.rank, self.role, self.traceback, self.died = rank, role, traceback, died


# How long the driver waits, once a host has failed, for a peer's death to surface: a host killed mid-collective
# makes its peers' collectives fail too (Gloo "connection reset"), often before Ray has reported the death.
ROOT_CAUSE_GRACE_S = 5.0


def failure_of(ref: Any, rank: int, info: list[dict[str, Any]], tw: int) -> HostFailure | None:
    """The failure a finished host's run call reports, or None if it returned cleanly."""
    role = role_of(rank, tw)
    try:
        res: HostResult = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        return HostFailure(rank, role, f"actor died ({type(e).__name__}); pid {info[rank]['pid']} "
                                       f"on {info[rank]['host']}", died=True)
    if res.ok:
        return None
    return HostFailure(rank, role, res.error.strip().splitlines()[0] if res.error else "unknown error", res.error)


def root_cause(first: HostFailure, refs: dict[Any, int], info: list[dict[str, Any]], tw: int) -> HostFailure:
    """The failure to name for a restart. A host that died outright is the cause and its peers' errors are
    consequences, so if `first` is an error rather than a death, the other hosts get ROOT_CAUSE_GRACE_S to report a
    death; the failures that are not named are logged, not dropped."""
    if first.died or not refs:
        return first
    others: list[HostFailure] = []
    deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
    while refs and time.monotonic() < deadline:
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            f = failure_of(ref, refs.pop(ref), info, tw)
            if f is not None:
                others.append(f)
        if any(f.died for f in others):
            break
    died = [f for f in others if f.died]
    named = died[0] if died else first
    for f in [first, *others]:
        if f is not named:
            log.warning("%s (after or because of host %d)", f, named.rank)
    return named


def report_late_failures(refs: dict[Any, int], info: list[dict[str, Any]], tw: int) -> None:
    """The trainer finished: a host that died meanwhile did not stop the run, but it is said, not swallowed."""
    if not refs:
        return
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in ready:
        f = failure_of(ref, refs[ref], info, tw)
        if f is not None:
            log.warning("%s, after the trainer's last step needed it", f)
