"""The scheduler of one replica's decode rows and slots: the queue of samples waiting for a row, the host-side ids
(slots) of the samples in the rows, and the decode calls that fill a row and take a finished one out.

A slot is the host's id for a (prompt, sample) while it holds a decode row; the device carries it in the row
(`DecodeState.slot`) and hands it back with the row it takes out, so the host knows whose tokens they are."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from asyncrl.inference.episodes import Fed, Queued, Target
from asyncrl.inference.layout import Layout
from asyncrl.inference.parking import ParkStore
from asyncrl.inference.programs import DecodePrograms
from asyncrl.inference.state import DecodeState, FinishedRow, unpack_row
from asyncrl.inference.stats import EngineStats
from asyncrl.inference.weights import Weights


@dataclass
class Outcome:
    """What one decode call did: whether its target went into a row (True without a target), and the finished row
    it took out with whose sample it was (None when no row finished)."""

    inserted: bool
    row: FinishedRow | None = None
    target: Target | None = None


class Scheduler:
    """The rows of one replica's decode batch and the samples queued for them. `store`: the park store of a
    multi-turn replica (None: single-turn), whose fed continuations a decode call takes from."""

    def __init__(self, layout: Layout, programs: DecodePrograms, weights: Weights, stats: EngineStats,
                 store: ParkStore | None):
        self.layout, self.programs, self.weights, self.stats, self.store = layout, programs, weights, stats, store
        self.state: DecodeState | None = None  # made at the first `generate` (an abstract engine allocates none)
        self.queue: collections.deque[Queued] = collections.deque()
        self.slots: dict[int, Target] = {}
        self.in_flight = 0  # rows holding a live sample
        self._slot_counter = 0
        self._dummy: DecodeState | None = None

    def prefill(self, prompts: Sequence[Sequence[int]]) -> DecodeState:
        lay = self.layout
        if len(prompts) > lay.P:
            raise ValueError(f"{len(prompts)} prompts > inference.max_prefill_prompts={lay.P}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) < lay.S:
                raise ValueError(f"prompt {i} has {len(p)} tokens; must be in [1, max_seq_len={lay.S})")
        toks, lens = lay.padded(prompts)
        params, version = self.weights.snapshot()
        t0 = time.perf_counter()
        state = lay.run(self.programs.prefill, toks, lens, np.int32(version), device=(params,))
        jax.block_until_ready(state.kv)
        self.stats.prefill_time += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        return state

    def dummy_prefill(self) -> DecodeState:
        """A prefill batch for calls that insert no prompt row (never read: the call inserts nothing from it)."""
        if self._dummy is None:
            self._dummy = self.prefill([[self.layout.pad_id]])
        return self._dummy

    def call(self, source: DecodeState | Fed | None, p: int, target: Target | None) -> Outcome:
        """One decode chunk, inserting `target` (row `p` of the prefill or extend batch `source`, or the fed
        continuation `source`) if a row is free or comes free, and taking one finished row out."""
        lay, stats = self.layout, self.stats
        params, version = self.weights.snapshot()
        # A multi-turn engine never substitutes into the row it takes out: with the batch full, this call only
        # takes a row out (its cache is then parked by its own program) and the next call fills the free slot.
        defer = bool(lay.Q) and target is not None and self.in_flight >= lay.B
        slot = -1
        if target is not None and not defer:
            slot = self._slot_counter
            self._slot_counter += 1
            self.slots[slot] = target
        fed = source if isinstance(source, Fed) else None
        feed = np.zeros((lay.F,), np.int32)
        if fed is not None:
            feed[: len(fed.feed)] = fed.feed
            source, p = None, 0
        if source is None:
            source = self.dummy_prefill()
        t0 = time.perf_counter()
        uid, k = (target.group.rollout.prompt.uid, target.k) if target is not None else (0, 0)
        scalars = (np.int32(-1 if defer else p), np.int32(slot), np.int32(version), np.uint32(uid & 0xFFFFFFFF),
                   np.int32(k), np.int32(lay.cfg.decode_chunk_steps), np.bool_(bool(self.queue)),
                   np.int32(fed.park if fed is not None else -1), feed, np.int32(len(fed.feed) if fed else 0))
        # Rows decoding through this chunk: a row filled into a free slot joins at its start, a substituted one at
        # its end.
        live = self.in_flight + int(target is not None and not defer and self.in_flight < lay.B)
        park_kv = self.store.kv if self.store is not None else None
        self.state, packed = lay.run(self.programs.decode, *scalars, device=(params, self.state, source, park_kv))
        # Waiting for the row waits for the device to finish the chunk, so decode_time (and the
        # decode_tokens_per_s metric built on it) is device time, and `between_loops` runs on executed work.
        row = unpack_row(np.asarray(jax.device_get(packed)), lay.S,
                         lay.routes)
        inserted, steps = bool(row.inserted), int(row.steps)
        dt = time.perf_counter() - t0
        stats.decode_time += dt
        stats.calls += 1
        stats.decode_steps += steps
        stats.slot_steps += live * steps
        stats.slot_time += live * dt
        if target is not None and not defer and not inserted:
            del self.slots[slot]
        if fed is not None and not defer and inserted:  # its cache is in a decode row now
            self.store.release(fed.park)  # type: ignore[union-attr]
            stats.fed_tokens += len(fed.feed) - 1
        self.in_flight += int(inserted)
        done = target is None or (not defer and inserted)
        if int(row.slot) < 0:
            return Outcome(done)
        self.in_flight -= 1  # a finished row came out
        return Outcome(done, row, self.slots.pop(int(row.slot)))
