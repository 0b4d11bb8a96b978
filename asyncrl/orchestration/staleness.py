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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.rollout import Rollout


@dataclass(frozen=True)
class Staleness:
    max_lag: int
    """`async.max_lag`: the most weight versions a trained token may lag the trainer (0 = on-policy)."""

    def lag(self, version: int, rollout: Rollout) -> int:
        """How many versions the group's oldest token lags a trainer at `version`."""
        return version - rollout.oldest_version

    def too_stale(self, version: int, rollout: Rollout) -> bool:
        """The collector drops such a group ("lag")."""
        return self.lag(version, rollout) > self.max_lag

    def last_chance(self, version: int, rollout: Rollout) -> bool:
        """Trainable now, too stale for the next step."""
        return self.lag(version, rollout) == self.max_lag

    def release_limit(self, prompts_per_step: int, synced_version: int, dropped: int, extra: int = 0) -> int:
        """Data positions below this may be released while inference holds `synced_version`."""
        return prompts_per_step * (synced_version + self.max_lag + 1) + dropped + extra

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
