"""A discrete-event model of the whole async pipeline: what `launch.py plan` runs to say how long a step takes
before a slice is booked, and why.

What it simulates, each as the real code does it (the module that does it in brackets):
- Continuous batching on every replica (`inference/engine.py`): a decode call runs steps over the live rows until
  one of them ends (or `decode_chunk_steps` pass); a step of n live rows costs `decode_step(n)`, a call
  `decode_call_s` besides. Rows enter free slots one per call and leave one per call (rows that finish together
  wait in their slots). A replica pulls
  the next `prefill_prompts` prompts from the shared queue when the rows of its last chunk are all in the batch,
  prefills them (its decode stops meanwhile), and fills free slots from them, `group_size` rows per prompt.
- The feeder's gate (`orchestration/staleness.py`): prompt positions below P (synced + max_lag + 1) + dropped +
  extra are released, `synced` being the version the inference replicas hold; zero-variance oversampling adds
  P f / (1 - f) extras with DAPO's filter.
- The collector (`orchestration/collect.py`): groups whose oldest token lags the trainer by more than max_lag are
  dropped (and credited, so a replacement is released); with the filter, zero-variance groups too (drawn with
  probability `zero_variance_share`). A step that holds P trainable groups still waits, up to
  `straggler_wait_s`, for in-flight groups it is the last step able to train (urgent), then trains the P oldest.
- The queues (`orchestration/queues.py`): each prompt and each group crosses two Ray queue calls (`queue_hop_s`
  each): the feeder puts prompts one by one, a replica takes each prompt of its chunk before it prefills, a
  shipper thread puts each finished group, and the trainer polls them one by one whenever it is not training.
- The trainer (`orchestration/trainer_worker.py`): a step of T tokens costs `train_step(T)`; then a weight sync:
  the trainer casts (`sync_cast_s`), the replicas park at the end of their current decode call, and the hop chain
  moves the weights (`sync_transfer_s`) once every replica has parked; the replicas resume under the new version
  and the feeder's gate opens by one step. With `overlap` the trainer goes on after the cast and waits for the
  chain only before its next sync; without it, it waits for the chain.
- Shared cores (`plan/cores.py`, a local run's hosts being processes of one machine): a train step and a replica's
  calls take longer while the other computes, by processor sharing; off (`shared_cores` 0) at target scale.

Outputs (`Result`): step time, trainer and inference busy fractions, decode-slot occupancy, groups dropped for lag
and zero variance, time the trainer is blocked on syncs, tokens per second per chip, over the steady state (the
first `skip_steps` steps left out).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from asyncrl.plan.cores import CoreShare, Cpu
from asyncrl.plan.inputs import Layout, Lengths, ProgramTimes
from asyncrl.plan.result import Result, steady_state


@dataclass
class _Row:
    pos: int
    length: int  # completion tokens
    remaining: int
    start_version: int  # the version that prefilled its prompt: its oldest token's


@dataclass
class _Group:
    pos: int
    released_at: int  # the synced version when the feeder released it
    left: int  # samples not finished yet
    oldest: int = 1 << 30
    tokens: int = 0  # prompt + completion tokens of every sample
    generated: int = 0
    zero_variance: bool = False


@dataclass
class _Replica:
    idx: int
    version: int = 0
    rows: list = field(default_factory=list)
    pending: deque = field(default_factory=deque)
    out: deque = field(default_factory=deque)  # finished rows still in their slots: one comes out per call
    busy: bool = False
    parked: bool = False
    phase_end: float | None = None  # queue calls made before the call about to start end here
    idle_since: float = 0.0
    counted: bool = False  # holds a share of the cores (`plan/cores.py`): from its call's queue calls to its end
    scale: float = 1.0  # its current call's stretch: 1 / the rate it got when the call started
    fresh: bool = True  # between calls: the next call takes its rate anew
    # (start, end, kind, live rows) of every call: integrated over the steady window afterwards
    calls: list = field(default_factory=list)


class Simulation:
    def __init__(self, times: ProgramTimes, lengths: Lengths, layout: Layout):
        self.t, self.L, self.lay = times, lengths, layout
        self.rng = np.random.default_rng(layout.seed)
        self.P, self.G = layout.prompts_per_step, layout.group_size
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.replicas = [_Replica(i) for i in range(layout.replicas)]
        self.cpu = Cpu(CoreShare(layout.shared_cores, layout.trainer_cores, layout.replica_cores), self._at,
                       lambda: self.now)
        # feeder
        self.synced: int | None = None
        self.next_pos = 0
        self.dropped = 0
        self.queue: deque = deque()  # prompts on the prompt queue
        self.feeder_free_at = 0.0  # the feeder thread puts prompts one at a time
        self.rqueue: deque = deque()  # groups on the rollout queue
        self.ship_free_at = [0.0] * layout.replicas
        self.polling = False
        self.groups: dict[int, _Group] = {}  # released, not yet consumed
        f = min(layout.zero_variance_share, 0.8)
        self.extra = math.ceil(self.P * f / (1 - f)) if layout.filter_zero_variance and f > 0 else 0
        # trainer
        self.version = 0
        self.pool: dict[int, _Group] = {}
        self.training = False
        self.waiting_since: float | None = None
        self.step_ends: list[float] = []
        self.train_spans: list[tuple[float, float]] = []
        self.blocked: list[tuple[float, float]] = []
        self.dropped_lag = self.dropped_zv = 0
        self.lags: list[int] = []
        self.trained_tokens: list[tuple[float, int, int]] = []  # (step end, tokens, generated)
        # sync
        self.sync_version: int | None = None  # the sync in progress (cast done, chain pending)
        self.chain_started = False
        self._block_start: float | None = None
        self._queued_sync: tuple[bool, float] | None = None

    # ---- events ---------------------------------------------------------------------------------------------

    def _at(self, when: float, fn, *args) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn, args))

    def run(self) -> Result:
        self._start_sync(initial=True)
        while self._events and len(self.step_ends) < self.lay.steps:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        if len(self.step_ends) < self.lay.steps:
            raise RuntimeError(f"plan: the pipeline stalled after {len(self.step_ends)} of {self.lay.steps} steps "
                               f"at t={self.now:.3f} s (queue {len(self.queue)}, pool {len(self.pool)})")
        return self._result()

    # ---- the feeder -----------------------------------------------------------------------------------------

    def _release(self) -> None:
        if self.synced is None:
            return
        limit = self.P * (self.synced + self.lay.max_lag + 1) + self.dropped + self.extra
        batch: list[int] = []  # prompts that reach the queue at the same time arrive together
        while self.next_pos < limit:
            g = _Group(self.next_pos, self.synced, self.G)
            g.zero_variance = bool(self.rng.random() < self.lay.zero_variance_share)
            self.groups[g.pos] = g
            at = max(self.now, self.feeder_free_at) + self.t.queue_hop_s
            if batch and at != self.feeder_free_at:
                self._at(self.feeder_free_at, self._prompts_queued, batch)
                batch = []
            self.feeder_free_at = at
            batch.append(g.pos)
            self.next_pos += 1
        if batch:
            self._at(self.feeder_free_at, self._prompts_queued, batch)

    def _prompts_queued(self, positions: list[int]) -> None:
        self.queue.extend(positions)
        for r in self.replicas:
            if not r.busy and not r.parked:
                self._replica_next(r)

    # ---- the replicas -------------------------------------------------------------------------------------

    def _replica_next(self, r: _Replica) -> None:
        """Replica `r` is between calls at `now`: park for a sync, prefill, decode, or idle."""
        r.busy = False
        r.fresh = True
        if self.sync_version is not None and not r.parked:
            self._stops(r)
            r.parked = True
            self._maybe_start_chain()
            return
        hop = self.t.queue_hop_s
        while r.pending and len(r.rows) < self.lay.decode_batch:  # one row per decode call
            r.rows.append(r.pending.popleft())
            if r.pending and len(r.rows) < self.lay.decode_batch:  # more to take in: this call returns at once
                self._phase(r, self._dur(r, self.t.decode_call_host_s), "host", 0)
                self._phase(r, self._dur(r, self.t.decode_call_s), "insert", len(r.rows))
                self._take_out(r, r.phase_end)  # the call also takes a finished row out (a swap)
        if r.out and not r.pending and not self.queue:
            # Nothing to take in: a finished row comes out in a call of its own, through the worker's loop
            # (`Engine.advance`: the two queue looks, host work, the call).
            self._phase(r, 2 * hop, "queue", 0)
            self._phase(r, self._dur(r, self.t.decode_call_host_s), "host", 0)
            dt = self._dur(r, self.t.decode_call_s)
            self._take_out(r, r.phase_end + dt)
            self._call(r, dt, "insert", len(r.rows))
            return
        # The worker takes the next prompts as soon as the last ones' rows are all in the batch, before it decodes.
        if not r.pending and self.queue:
            n = min(self.lay.prefill_prompts, len(self.queue))
            prompts = [self.queue.popleft() for _ in range(n)]
            # The replica thread's queue calls: the eval queue first, then one per prompt, and one that finds the
            # queue empty when the chunk is short (`InferenceWorker._next_requests`).
            calls = 1 + n + (n < self.lay.prefill_prompts)
            self._phase(r, calls * hop, "queue", 0)
            for pos in prompts:
                lens = self.L.draw(self.rng, self.G)
                g = self.groups[pos]
                g.oldest = min(g.oldest, r.version)
                for n_tok in lens:
                    r.pending.append(_Row(pos, int(n_tok), int(n_tok), r.version))
            self._call(r, self._dur(r, self.t.prefill(n * self.L.prompt)), "prefill", 0)
            return
        if not r.rows:
            self._stops(r)
            r.idle_since = self.now
            return  # idle until prompts are released or a sync ends
        if not r.pending:  # no rows waiting: the loop looks at both prompt queues before each decode call
            self._phase(r, 2 * hop, "queue", 0)
        self._phase(r, self._dur(r, self.t.decode_call_host_s), "host", 0)
        k = min(min(x.remaining for x in r.rows), self.lay.decode_chunk_steps)
        n = len(r.rows)
        dt = self._dur(r, self.t.decode_call_s + k * self.t.decode_step(n))
        done = []
        for x in r.rows:
            x.remaining -= k
            if x.remaining == 0:
                done.append(x)
        r.rows = [x for x in r.rows if x.remaining > 0]
        start = r.phase_end if r.phase_end is not None else self.now
        # A call takes one finished row out; rows that finish together wait in their slots for later calls.
        self._take_out(r, start + dt)
        r.out.extend(done)
        if done:
            self._at(start + dt, self._sample_done, r.out.popleft(), r.idx)
        self._call(r, dt, "decode", n)

    def _dur(self, r: _Replica, solo: float) -> float:
        """A replica's compute of `solo` s alone, stretched by its share of the cores as its call starts."""
        if r.fresh:  # queue calls are waits on other processes, not compute: never stretched
            r.fresh, r.scale, r.counted = False, self.cpu.replica_scale(starts=not r.counted), True
        return self.cpu.replica_work(solo, r.scale)

    def _stops(self, r: _Replica) -> None:
        if r.counted:
            r.counted = False
            self.cpu.replica_stops()

    def _take_out(self, r: _Replica, when: float) -> None:
        if r.out:
            self._at(when, self._sample_done, r.out.popleft(), r.idx)

    def _phase(self, r: _Replica, dt: float, kind: str, live: int) -> None:
        """Time on the replica's thread before its next call (queue calls): recorded, and the call starts after."""
        start = r.phase_end if r.phase_end is not None else self.now
        if dt > 0:
            r.calls.append((start, start + dt, kind, live))
        r.phase_end = start + dt

    def _call(self, r: _Replica, dt: float, kind: str, live: int) -> None:
        start = r.phase_end if r.phase_end is not None else self.now
        r.phase_end = None
        r.busy = True
        r.calls.append((start, start + dt, kind, live))
        self._at(start + dt, self._replica_next, r)

    def _sample_done(self, row: _Row, replica: int) -> None:
        g = self.groups[row.pos]
        g.left -= 1
        g.tokens += self.L.prompt + row.length
        g.generated += row.length
        g.oldest = min(g.oldest, row.start_version)
        if g.left == 0:  # verified, then shipped: one queue call after the last one this replica made
            ready = self.now + self.t.verifier_s
            self.ship_free_at[replica] = max(ready, self.ship_free_at[replica]) + self.t.queue_hop_s
            self._at(self.ship_free_at[replica], self._group_queued, g)

    # ---- the trainer ----------------------------------------------------------------------------------------

    def _group_queued(self, g: _Group) -> None:
        self.rqueue.append(g)
        self._poll()

    def _poll(self) -> None:
        """The trainer takes the next group off the rollout queue, unless it is training or syncing."""
        if self.polling or self.training or not self.rqueue or len(self.step_ends) >= self.lay.steps:
            return
        self.polling = True
        self._at(self.now + self.t.queue_hop_s, self._polled, self.rqueue.popleft())

    def _polled(self, g: _Group) -> None:
        self.polling = False
        del self.groups[g.pos]
        if g.zero_variance and self.lay.filter_zero_variance:
            self.dropped_zv += 1
            self.dropped += 1
            self._release()
        else:
            self.pool[g.pos] = g
            self._try_step()
        self._poll()

    def _try_step(self) -> None:
        if self.training or self.polling or len(self.step_ends) >= self.lay.steps:
            return
        for pos, g in list(self.pool.items()):
            if self.version - g.oldest > self.lay.max_lag:
                del self.pool[pos]
                self.dropped_lag += 1
                self.dropped += 1
        self._release()
        if len(self.pool) < self.P:
            return
        urgent = [p for p, g in self.groups.items() if g.released_at <= self.version - self.lay.max_lag]
        if urgent and self.lay.straggler_wait_s > 0:
            if self.waiting_since is None:
                self.waiting_since = self.now
                self._at(self.now + self.lay.straggler_wait_s, self._try_step)
            if self.now < self.waiting_since + self.lay.straggler_wait_s:
                return
        self.waiting_since = None
        take = sorted(self.pool)[: self.P]
        batch = [self.pool.pop(p) for p in take]
        self.lags += [self.version - g.oldest for g in batch]
        tokens = sum(g.tokens for g in batch)
        generated = sum(g.generated for g in batch)
        dt = self.t.train_step(tokens)
        self.training = True
        self.cpu.train(dt, self._train_done, tokens, generated)  # beside the busy replicas on a shared machine

    def _train_done(self, start: float, tokens: int, generated: int) -> None:
        self.train_spans.append((start, self.now))
        self.version += 1
        self.step_ends.append(self.now)
        self.trained_tokens.append((self.now, tokens, generated))
        self._start_sync(initial=False)

    # ---- weight sync ----------------------------------------------------------------------------------------
    # The trainer is held from `start` (its sync call) until the cast is done (with overlap) or the chain is (without
    # it, and for the initial sync); a sync called while the previous chain still runs first waits for that chain.

    def _start_sync(self, initial: bool) -> None:
        self.training = True  # no step starts while the trainer is in a sync
        if self.sync_version is not None:
            self._queued_sync = (initial, self.now)
            return
        self._at(self.now + self.t.sync_cast_s, self._cast_done, initial, self.now)

    def _cast_done(self, initial: bool, start: float) -> None:
        self.sync_version = self.version
        self.chain_started = False
        cycle = self.t.idle_poll_s + 2 * self.t.queue_hop_s  # an idle replica's look at its queues
        for r in self.replicas:
            if not r.busy and not r.parked:
                if cycle > 0:  # it parks when its current look ends
                    r.busy = True
                    ends = r.idle_since + math.ceil(max(self.now - r.idle_since, 1e-12) / cycle) * cycle
                    self._at(ends, self._replica_next, r)
                else:
                    self._replica_next(r)
        self._maybe_start_chain()
        if self.lay.overlap and not initial:
            self.blocked.append((start, self.now))
            self.training = False
            self._try_step()
            self._poll()
        else:
            self._block_start = start

    def _maybe_start_chain(self) -> None:
        if self.sync_version is None or self.chain_started or not all(r.parked for r in self.replicas):
            return
        self.chain_started = True
        self._at(self.now + self.t.sync_transfer_s, self._chain_done)

    def _chain_done(self) -> None:
        v, self.sync_version = self.sync_version, None
        for r in self.replicas:
            r.version, r.parked = v, False
        self.synced = v
        if self._block_start is not None:  # the trainer waited for this chain
            self.blocked.append((self._block_start, self.now))
            self._block_start = None
            self.training = False
        if self._queued_sync is not None:  # the trainer's next sync waited for this chain: its cast starts now
            initial, start = self._queued_sync
            self._queued_sync = None
            self._at(self.now + self.t.sync_cast_s, self._cast_done, initial, start)
        for r in self.replicas:
            if not r.busy:
                self._replica_next(r)
        self._release()
        self._try_step()
        self._poll()

    def _result(self) -> Result:
        return steady_state(self)


def simulate(times: ProgramTimes, lengths: Lengths, layout: Layout) -> Result:
    return Simulation(times, lengths, layout).run()
