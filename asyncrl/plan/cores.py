"""Processes that share one machine's cores: the contention term of the pipeline model (`plan/sim.py`).

Here (`platform: cpu`) the trainer and every inference replica are processes of one machine, and XLA's CPU runtime
sizes each process's thread pool to the whole machine, so when the trainer and a replica compute at once each gets
a share of the cores and runs slower. How much depends on how much of their time they overlap, which the layout sets
(at max_lag 0 the replica mostly waits while the trainer trains; at max_lag 2 they run side by side). Costs fitted
from a run absorb the contention that run had; a what-if that changes the overlap must change it too. So the model
holds SOLO costs (work at full speed) and slows each process down by the overlap the simulation produces.

The model is processor sharing, the simplest one with no per-layout parameter: each busy process asks for `demand`
cores, and when the busy processes ask for more than the machine has, every one of them advances its work at
rate = cores / (sum of busy demands) (else at rate 1). Why this one: a fitted slowdown per overlap state (trainer +
1 replica, trainer + 2 replicas, ...) needs a run of every state to fit, and a what-if adding a replica asks for a
state no run had; processor sharing gives every state from the cores and one demand per process. Each process's
demand is the machine (`cores`) unless told: the XLA pool's size, what the processes here actually ask for.

At target scale every host is its own machine (TPU hosts do not share chips): `cores` 0 turns the term off, and
with cores >= the sum of every demand the rate is always 1 and nothing is rescheduled, so the simulation is exactly
the one without it (tests/test_plan_cores.py).

Two granularities, for cost: the trainer's step (hundreds of ms, during which many replica calls start and end) is
a true processor-sharing job, its remaining work re-timed whenever the busy set changes; a replica's call (ms) runs
at the rate it gets when it starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CoreShare:
    """The machine the processes share (`Layout.shared_cores` and the demands)."""

    cores: float = 0.0
    """Cores of the one machine all processes run on; 0: each process has a machine of its own (no contention)."""
    trainer: float = 0.0
    """Cores a busy trainer asks for (0: all `cores`)."""
    replica: float = 0.0
    """Cores a busy replica asks for (0: all `cores`)."""

    @property
    def on(self) -> bool:
        return self.cores > 0

    def rate(self, trainer_busy: bool, replicas_busy: int) -> float:
        """The speed (solo work per second) of each busy process when these are busy."""
        if not self.on:
            return 1.0
        demands = [self.trainer or self.cores] * trainer_busy + [self.replica or self.cores] * replicas_busy
        return share_rate(self.cores, demands)


def share_rate(cores: float, demands: Sequence[float]) -> float:
    """Processor sharing: every busy process advances at min(1, cores / total demand)."""
    total = float(sum(demands))
    return 1.0 if total <= cores else cores / total


@dataclass
class _Job:
    remaining: float  # solo seconds of work left at `since`
    rate: float
    since: float
    start: float
    seq: int
    fn: Callable
    args: tuple


class Cpu:
    """The shared cores inside one simulation: the trainer's step as a sharing job, the replicas' calls as holders
    of a share. `schedule(when, fn, *args)` and `clock()` are the simulation's event queue and time."""

    def __init__(self, share: CoreShare, schedule: Callable[..., None], clock: Callable[[], float]):
        self.share, self._at, self._now = share, schedule, clock
        self.replicas_busy = 0
        self.job: _Job | None = None
        self._seq = 0
        # What the contention cost, summed: solo work and the wall time it took (the fit divides by their ratio).
        self.train_solo = self.train_wall = self.replica_solo = self.replica_wall = 0.0

    # ---- the trainer -----------------------------------------------------------------------------------------

    def train(self, work: float, fn: Callable, *args: Any) -> None:
        """Start a train step of `work` solo seconds; `fn(start, *args)` runs when it is done."""
        now = self._now()
        rate = self.share.rate(True, self.replicas_busy)
        self._seq += 1
        self.job = _Job(work, rate, now, now, self._seq, fn, args)
        self.train_solo += work
        self._at(now + work / rate, self._train_done, self._seq)
        self._rebalance()  # the replicas' next calls see the trainer busy

    def _train_done(self, seq: int) -> None:
        job = self.job
        if job is None or job.seq != seq:  # re-timed since: a later event ends it
            return
        self.job = None
        now = self._now()
        self.train_wall += now - job.start
        job.fn(job.start, *job.args)

    def _rebalance(self) -> None:
        """Re-time the trainer's step if its rate changed (only then: with no contention nothing moves)."""
        job = self.job
        if job is None:
            return
        rate = self.share.rate(True, self.replicas_busy)
        if rate == job.rate:
            return
        now = self._now()
        job.remaining -= (now - job.since) * job.rate
        job.since, job.rate = now, rate
        self._seq += 1
        job.seq = self._seq
        self._at(now + max(job.remaining, 0.0) / rate, self._train_done, job.seq)

    # ---- the replicas ----------------------------------------------------------------------------------------

    def replica_scale(self, starts: bool) -> float:
        """A replica's call starts (`starts`: and the replica was not computing before): the factor the call's solo
        times stretch by, 1 / the rate it gets now."""
        if starts:
            self.replicas_busy += 1
            self._rebalance()
        return 1.0 / self.share.rate(self.job is not None, self.replicas_busy)

    def replica_stops(self) -> None:
        self.replicas_busy -= 1
        self._rebalance()

    def replica_work(self, solo: float, scale: float) -> float:
        self.replica_solo += solo
        self.replica_wall += solo * scale
        return solo * scale

    @property
    def train_slowdown(self) -> float:
        return self.train_wall / self.train_solo if self.train_solo > 0 else 1.0

    @property
    def replica_slowdown(self) -> float:
        return self.replica_wall / self.replica_solo if self.replica_solo > 0 else 1.0
