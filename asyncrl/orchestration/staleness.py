"""Staleness, both halves in one place: when a prompt may be released (the feeder, `feeder.py`), when a group may
be trained (the collector, `collect.py`), and what one tells the other. To try another staleness policy, change
this class; the feeder and the collector only ask it.

Versions. The trainer's params after step s are version s; step s + 1 (1-based) trains on version s. A group's lag
is the trainer's version minus the oldest weights behind any of its tokens (`Rollout.oldest_version`): the version
each token was sampled with, and the version whose prefill computed the prompt's cached keys and values (a replica
can prefill under v - 1 and swap to v before its first decode step). A group is trained only if its lag is at most
`max_lag`.

The release gate. A prompt released once the inference hosts hold version v is sampled at >= v, so the prompts of
step s may go out as soon as v >= s - 1 - max_lag, and not earlier: at most P * (v + max_lag + 1) positions, plus
one more for every group dropped so far (a dropped group's step still needs a replacement), plus what the feeder
oversamples. No step of slack: a prompt released earlier would come back too stale and be dropped, its decode
wasted.

Urgent groups. Groups finish out of order, so a step that takes whatever arrives first can take the next step's
quick groups and leave its own stragglers to come back too stale. A prompt released at version r is at least
`version - r` stale when it comes back; once that is max_lag, the step training on `version` is its last chance:
it is urgent, and the collector waits for it (up to `StragglerWait.current_s`) before taking newer groups.

Adaptive admission (`async.admission: adaptive`, `Admission`). The release gate above uses a lag `ahead` in
[0, max_lag] instead of max_lag: the feeder then releases P * ahead prompts ahead of the on-policy ones. The
trainer measures, per group, the Kish ESS of its importance weights pi_prox / pi_sampler (`train/ess.py`) and
reports each step's ESS by lag (`Admission.observe`): while the stalest groups it trained keep their ESS at or
above `async.ess_target`, `ahead` grows by one a step, up to max_lag (the hard cap, which the collector still
enforces); once it falls below, `ahead` shrinks by one a step. A group whose lag measured an ESS below
`async.ess_floor` (over the last `FLOOR_WINDOW` steps) is dropped on arrival, with reason "ess", and credited to
the feeder like a lag drop: one more prompt goes out at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.rollout import Rollout

# How many steps a lag's measured ESS stays in force for the floor. Groups of a lag under the floor are dropped, so
# that lag measures nothing new while they are; once its figure is this old, the lag is admitted again and measured.
FLOOR_WINDOW = 10


@dataclass
class Admission:
    """How far ahead the feeder releases, chosen from the ESS the trainer measures (`async.admission: adaptive`).

    Every trainer host holds one and observes the same combined figures, so their collectors drop alike. The
    trainer thread writes `ahead`; the feeder thread reads it on its next poll (an int: no lock needed)."""

    max_lag: int
    ess_target: float
    ess_floor: float = 0.0
    ahead: int = 0
    """The lag the release gate uses now, in [0, max_lag]. It starts on-policy and grows as the ESS allows."""
    floor_ess: dict[int, tuple[float, int]] = field(default_factory=dict)
    """lag -> (its smoothed ESS, the step that last measured it): what the floor compares with."""

    def __post_init__(self) -> None:
        if not 0 <= self.ahead <= self.max_lag:
            raise ValueError(f"Admission.ahead={self.ahead} must be in [0, async.max_lag={self.max_lag}]")

    def observe(self, step: int, ess_by_lag: dict[int, float]) -> None:
        """A trained step's mean ESS per lag (the lags it trained). The stalest lag decides: at or above the
        target, one lag more may be released ahead; below, one less. Lower lags' ESS is no news (it is higher)."""
        if not ess_by_lag:
            return
        for lag, ess in ess_by_lag.items():
            old = self.floor_ess.get(lag)
            fresh = old is not None and step - old[1] <= FLOOR_WINDOW
            self.floor_ess[lag] = (0.5 * old[0] + 0.5 * ess if fresh else ess, step)
        stalest = ess_by_lag[max(ess_by_lag)]
        if stalest >= self.ess_target:
            self.ahead = min(self.ahead + 1, self.max_lag)
        else:
            self.ahead = max(self.ahead - 1, 0)

    def below_floor(self, lag: int, step: int) -> bool:
        """Groups of `lag` measured (recently) an ESS under the floor. Never lag 0: its replacement would come
        back at lag 0 again, be dropped again, and the step would never fill (nor the figure ever expire, as it
        ages by trained steps)."""
        measured = self.floor_ess.get(lag)
        return (lag > 0 and self.ess_floor > 0 and measured is not None and step - measured[1] <= FLOOR_WINDOW
                and measured[0] < self.ess_floor)

    def state(self) -> dict[str, object]:
        """Checkpoint meta: a resumed run releases and drops as the uninterrupted one would."""
        return {"ahead": self.ahead, "floor_ess": {str(lag): list(v) for lag, v in self.floor_ess.items()}}

    def restore(self, state: dict[str, object]) -> None:
        self.ahead = min(int(state["ahead"]), self.max_lag)  # type: ignore[call-overload]
        floor = state.get("floor_ess") or {}
        self.floor_ess = {int(lag): (float(v[0]), int(v[1])) for lag, v in floor.items()}  # type: ignore[union-attr]


@dataclass(frozen=True)
class Staleness:
    max_lag: int
    """`async.max_lag`: the most weight versions a trained token may lag the trainer (0 = on-policy)."""
    admission: Admission | None = None
    """`async.admission: adaptive`: releases `admission.ahead` versions ahead, drops lags under the ESS floor.
    None (fixed): releases max_lag ahead, drops only past max_lag."""

    def __post_init__(self) -> None:
        if self.admission is not None and self.admission.max_lag != self.max_lag:
            raise ValueError(f"Admission.max_lag={self.admission.max_lag} differs from max_lag={self.max_lag}")

    def lag(self, version: int, rollout: Rollout) -> int:
        """How many versions the group's oldest token lags a trainer at `version`."""
        return version - rollout.oldest_version

    def too_stale(self, version: int, rollout: Rollout) -> bool:
        """The collector drops such a group ("lag")."""
        return self.lag(version, rollout) > self.max_lag

    def drop_reason(self, version: int, rollout: Rollout) -> str | None:
        """Why the collector drops this group, or None to admit it: "lag" past max_lag; with adaptive admission,
        "ess" when its lag measured an ESS under the floor. Dropped rather than down-weighted: its own weights are
        known only in the step that trains it, and down-weighting by them is what the rollout correction
        (loss.is_mode / loss.tis_cap) already does per token; a group from a lag this far off-policy carries little
        signal for a full group's compute, and dropping it buys a fresh, less stale replacement at once.
        Trainer version `version` trains as step version + 1."""
        if self.too_stale(version, rollout):
            return "lag"
        if self.admission is not None and self.admission.below_floor(self.lag(version, rollout), version + 1):
            return "ess"
        return None

    @property
    def ahead(self) -> int:
        """The lag the release gate uses: max_lag (fixed), or what adaptive admission allows now."""
        return self.max_lag if self.admission is None else self.admission.ahead

    def last_chance(self, version: int, rollout: Rollout) -> bool:
        """Trainable now, too stale for the next step."""
        return self.lag(version, rollout) == self.max_lag

    def release_limit(self, prompts_per_step: int, synced_version: int, dropped: int, extra: int = 0) -> int:
        """Data positions below this may be released while inference holds `synced_version`."""
        return prompts_per_step * (synced_version + self.ahead + 1) + dropped + extra

    def urgent(self, released_at: dict[int, int], version: int) -> set[int]:
        """Of the in-flight positions (-> the synced version when each was released), those a step training on
        `version` must wait for: they cannot be trained by a later step."""
        return {p for p, r in released_at.items() if r <= version - self.max_lag}


@dataclass
class StragglerWait:
    """How long a step that already holds its groups waits for its urgent ones, adapted to what it measures.

    A fixed wait is wrong somewhere: on a quiet machine stragglers arrive within a fraction of a second, while with
    a long tail of completion lengths, or big models whose steps take many seconds, they take longer, miss the wait,
    and come back one version too stale: a lag drop, their decode wasted, a replacement to generate. The collector
    reports each step (`observe`): the delays of the urgent groups it waited for, and whether it gave up on some. A
    give-up doubles the wait; a step whose stragglers all came in time shortens it by 10%, but never below twice the
    longest delay just seen, nor below `floor_s`.

    Waiting must pay for itself: a waiting trainer idles, and holds back the release of the next step's prompts. So
    the wait never exceeds the trainer's own busy time per step (`note_busy`: its step time less its waits, a running
    mean), nor `cap_s`: the trainer idles for stragglers at most as long as it works. Measured with one inference
    host 3x slower than the other (benchmarks/README.md): waiting up to 8 s cut its lag drops from 10 % to 1.1 % but
    doubled the wall time; bounded by the busy time, the wait stays at the floor there, as it should."""

    floor_s: float = 0.5
    cap_s: float = 8.0
    adaptive: bool = True
    current_s: float = field(init=False)
    busy_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.current_s = self.floor_s

    def note_busy(self, seconds: float) -> None:
        """A step's working time (its wall time less its waits for groups)."""
        self.busy_s = seconds if self.busy_s == 0.0 else 0.8 * self.busy_s + 0.2 * seconds

    def observe(self, delays: list[float], gave_up: bool) -> None:
        if not self.adaptive:
            return
        bound = max(self.floor_s, min(self.cap_s, self.busy_s if self.busy_s > 0 else self.cap_s))
        if gave_up:
            want = max(2.0 * self.current_s, 0.1)
        else:
            want = max(0.9 * self.current_s, 2.0 * max(delays, default=0.0))
        self.current_s = min(bound, max(self.floor_s, want))
