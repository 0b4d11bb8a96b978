"""The prompt feeder (trainer rank 0): releases train prompts under the exact staleness gate
(`staleness.py`), and keeps the account of every data position it released, so a checkpoint can say which
prompts were still in flight.

Credit. Every trainer host tells the feeder about each group it consumes (trained or dropped) as soon as it sees
it, through `consumed(position, reason)` on rank 0 and a queue from the other ranks. A drop frees a position
immediately, so a trainer short of groups (zero-variance filtering, lag) never waits for prompts that nobody
releases.

Oversampling. Replacing drops one at a time is correct but serial: when most groups have zero variance (DAPO late
in training) each replacement is a full round trip, and a step takes dozens of them. So the feeder also releases,
up front, the replacements it expects to need: `oversample_for(P)` extra prompts per step, from a running
estimate f of the zero-variance share (P f / (1 - f), at most 4 P). At max_lag = 0 the extras a step does not
use come back one version too stale and are dropped for lag (DAPO's own oversampling discards them too); at
max_lag >= 1 the trainer carries them to the next step.

Resume. `state()` records the next new position, the dropped count, the positions released but not yet
consumed, and the zero-variance share (so DAPO's oversampling does not restart cold). `restore()` puts those
in-flight positions first in line: a resumed run generates them again, with the same per-position seeds, so
nothing is skipped and nothing is trained twice, whatever `max_lag` is.

No Ray here: `put(item, timeout)` and `samples()` are plain callables, so the logic is tested in-process.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from asyncrl.orchestration.messages import GroupConsumed
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Prompt

log = logging.getLogger(__name__)


class FeederError(RuntimeError):
    """The feeder thread died; the message carries its own traceback."""


class Feeder:
    def __init__(self, samples: Callable[[], Iterator[Any]], put: Callable[[Prompt, float], None], *,
                 prompts_per_step: int, staleness: Staleness, group_size: int, oversample: bool = False,
                 drain_remote: Callable[[], list[GroupConsumed]] | None = None, poll_s: float = 0.02,
                 timeout_s: float = 300.0, who: str = "trainer0"):
        self._samples, self._put, self._drain_remote = samples, put, drain_remote
        self.P, self.staleness, self.n, self.poll_s = prompts_per_step, staleness, group_size, poll_s
        self.timeout_s, self.who = timeout_s, who
        self.lock = threading.Lock()
        # Notified when the gate may have opened (a sync landed, a group was dropped): the feeder thread wakes at
        # once instead of at its next poll (a 20 ms sleep cost every step ~10 ms before its first prompt went out).
        self._opened = threading.Condition(self.lock)
        # Held from popping the other ranks' reports to applying the last of them, so a drain that finds the queue
        # empty has waited for one in progress: the snapshot after it (a checkpoint) sees every report applied.
        self._drain_lock = threading.Lock()
        self.position = 0  # next new data position
        self.dropped = 0
        self.in_flight: set[int] = set()  # released, not yet consumed
        self.released_at: dict[int, int] = {}  # in-flight position -> the synced version when it was released
        self.oversample = oversample
        self.zero_variance_share = 0.0  # running estimate over consumed groups (drives oversampling)
        self._redo: list[int] = []  # in-flight positions of a checkpoint, released again first
        self.synced_version = -1  # the version the inference hosts hold
        self.stop = threading.Event()
        self.error: FeederError | None = None
        self._thread: threading.Thread | None = None

    # ---- accounting ----------------------------------------------------------------------------------------

    def allowed(self) -> int:
        """New positions below this may be released now (`Staleness.release_limit`)."""
        return self.staleness.release_limit(self.P, self.synced_version, self.dropped, self.oversample_for(self.P))

    def oversample_for(self, n: int) -> int:
        if not self.oversample:
            return 0
        f = min(self.zero_variance_share, 0.8)  # 0.8: at most 4 n extra
        return int(np.ceil(n * f / (1 - f)))

    def consumed(self, position: int, reason: str | None) -> None:
        """A trainer host took (reason None) or dropped ("lag", "ess", "zero_variance") a group: it leaves the
        in-flight set, and a drop lets one more prompt out at once."""
        with self.lock:
            if position not in self.in_flight:
                raise ValueError(f"feeder: group at data position {position} was never released or was already "
                                 f"consumed (in flight: {sorted(self.in_flight)[:8]}...)")
            self.in_flight.discard(position)
            self.released_at.pop(position, None)
            if reason is not None:
                self.dropped += 1
                self._opened.notify_all()
            if reason not in ("lag", "ess", "failed"):  # staleness and failure drops say nothing about the rewards
                self.zero_variance_share += 0.05 * (float(reason == "zero_variance") - self.zero_variance_share)

    def drain_remote(self) -> None:
        """Apply what the other trainer hosts reported. The feeder thread calls it while it waits, and the trainer
        thread before it snapshots `state()` for a checkpoint: popping and applying happen under one lock, so the
        snapshot never lists a position in flight that another thread has already popped as consumed."""
        if self._drain_remote is not None:
            with self._drain_lock:
                for m in self._drain_remote():
                    self.consumed(m.position, m.reason)

    def urgent(self, version: int) -> set[int]:
        """In-flight positions that a step training on `version` must wait for (`Staleness.urgent`)."""
        with self.lock:
            return self.staleness.urgent(self.released_at, version)

    def set_synced(self, version: int) -> None:
        with self.lock:
            self.synced_version = version
            self._opened.notify_all()

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"position": self.position, "dropped": self.dropped, "in_flight": sorted(self.in_flight),
                    "zero_variance_share": self.zero_variance_share}

    def restore(self, state: dict[str, Any]) -> None:
        """From `state()` of a checkpoint. A checkpoint from before in-flight tracking has no list: it resumes at
        its position, as it always did."""
        with self.lock:
            self.position, self.dropped = int(state["position"]), int(state.get("dropped", 0))
            # DAPO's oversampling estimate: without it a resumed run would oversample nothing until it relearned.
            self.zero_variance_share = float(state.get("zero_variance_share", 0.0))
            self._redo = sorted(int(p) for p in state.get("in_flight", []))
            self.in_flight = set(self._redo)  # still owed, even before they are released again
            if any(p >= self.position for p in self._redo):
                raise ValueError(f"checkpoint meta: in-flight positions {self._redo} must be below position "
                                 f"{self.position}")

    # ---- the thread ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prompt-feeder", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the feeder thread's error (with its traceback) in the caller."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the trainer's loop raises it (check) and the driver prints it
            self.error = FeederError(f"the prompt feeder thread died: {e!r}\n{traceback.format_exc()}")
            self.stop.set()

    def _loop(self) -> None:
        redo = set(self._redo)
        it = self._samples()
        wanted = {}
        # Walk the data stream to the resume point, keeping the samples of the positions to generate again.
        for pos, sample in zip(range(self.position), it):
            if pos in redo:
                wanted[pos] = sample
        for pos in self._redo:
            self._release(pos, wanted[pos], new=False)
        self._redo = []
        last_drain = 0.0
        for sample in it:
            while not self.stop.is_set():
                if time.monotonic() - last_drain > 0.1:  # a queue round trip: not on every 20 ms poll
                    self.drain_remote()
                    last_drain = time.monotonic()
                with self.lock:
                    ok = self.position < self.allowed()
                    if not ok:
                        self._opened.wait(self.poll_s)  # the lock is released while it waits
                if ok:
                    break
            if self.stop.is_set():
                return
            self._release(self.position, sample, new=True)

    def _release(self, position: int, sample: Any, new: bool) -> None:
        # In flight from before the put (a fast consumer may report it back before `put` returns) until a trainer
        # consumes it; one the queue never took stays owed, so a checkpoint still lists it.
        with self.lock:
            self.in_flight.add(position)
            self.released_at[position] = self.synced_version
            if new:
                self.position = position + 1
        item = Prompt(position, sample, self.n)
        deadline = time.monotonic() + self.timeout_s
        while not self.stop.is_set():  # the prompt queue is bounded: wait in short slices, stoppable
            try:
                self._put(item, 1.0)
                return
            except TimeoutError:
                self.drain_remote()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.who} prompt feeder waited {self.timeout_s:.0f}s to put the prompt "
                                       f"at data position {position} on the full 'prompt' queue; no inference "
                                       "host is taking prompts") from None
