"""The turns of the engine's episodes, mixed into `Engine`: each environment step on a worker thread, its answer
taken back on the decode thread (`_poll_env`), and the continuations launched back into the decode batch ahead of
new prompts (`_launch_ready`): fed by decode steps from their parked caches when short, through `extend` from them
when longer, or, for a cache the park store had no room for, through a prefill of the whole history."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from asyncrl.inference.episodes import Continuation, Episode, Fed, Group, Queued
from asyncrl.rollout import StepResult, Turn

log = logging.getLogger(__name__)


class EpisodeDriver:
    """Needs the engine's `cfg`, `S`, `P`, `B`, `name`, `stats`, `_lock`, `params`, `version`, `_park`, `_run`,
    `_padded`, `_extend`, `extend_min_bucket`, `extend_rows`, `prefill`, `_in_flight` and its host queues
    (`_stepping`, `_ready`, `_free_park`, `_queue`, `_pool`, `_emit`)."""

    def _step(self, ep: Episode, turn: Turn) -> Future:
        """The environment's step, on a worker thread; it records its own duration."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cfg.env_threads, thread_name_prefix=f"{self.name}-env")

        def timed() -> tuple[StepResult, float]:
            t0 = time.perf_counter()
            res = ep.env.step(turn)  # type: ignore[union-attr]
            return res, time.perf_counter() - t0

        return self._pool.submit(timed)

    def _poll_env(self) -> None:
        """Take the environments' answers that have come: end an episode, or ready its next turn."""
        still = []
        for s in self._stepping:
            if not s.future.done():
                still.append(s)
                continue
            group, k, ep = s.target.group, s.target.k, s.target.episode
            self.stats.env_steps += 1
            try:
                res, dt = s.future.result()
                ep.env_s += dt
                self.stats.env_time += dt
            except Exception as e:  # noqa: BLE001 - an environment's failure ends its episode, never the run
                log.warning("%s: the environment of %s (sample %d) failed at turn %d: %r", self.name,
                            group.rollout.prompt.id, k, ep.turn - 1, e)
                res = StepResult(None, 0.0, True, reason="env_error", info={"error": repr(e)})
            if res.info:
                ep.env_info.append(res.info)
            end = self._end_reason(ep, res, s.last)
            if end is None:
                feed = np.concatenate([ep.parts[-1].tokens[-1:], np.asarray(res.observation, np.int32)])
                self._ready.append(Continuation(group, k, feed, s.park))
            else:
                self._release(s.park)
                ep.end(res, end)
                self._maybe_emit(group)
        self._stepping = still

    def _end_reason(self, ep: Episode, res: StepResult, last: bool) -> str | None:
        """None to go on; else why the episode ends."""
        if res.done:
            return "done" if res.reason != "env_error" else "env_error"
        if last:
            return "max_turns" if ep.turn >= self.cfg.max_turns else "context"
        obs = res.observation
        if obs is None or len(obs) == 0:
            return "env_error"  # a step that continues must say something
        cap = self.cfg.max_observation_tokens
        if cap is not None and len(obs) > cap:
            return "obs_cap"
        if ep.length + len(obs) + 1 >= self.S:  # the observation and at least one sampled token must fit
            return "context"
        return None

    def _release(self, park: int) -> None:
        if park >= 0:
            self._free_park.append(park)

    def _maybe_emit(self, group: Group) -> None:
        if group.done and self._emit is not None:
            self._emit(group.finish())

    def _launch_ready(self) -> None:
        """Continuations back into the decode batch, ahead of new prompts. One of at most
        `inference.decode_feed_tokens` tokens with a parked cache is queued as it is: the decode call that puts it
        in a free slot takes its cache from the park store, and the steps feed its tokens (no extra program, no
        wait). Others go up to P at a time through `extend`
        from their parked caches, or, for a cache the park store had no room for, a prefill of the history.
        An extend reads every weight once, as a decode step does, whatever its rows: while other work keeps the
        decode batch full (queued rows, no free slot), continuations wait up to `inference.extend_wait_s` to be
        extended P at a time rather than one by one (measured: 2.5 rows a call cost 21% of a replica's time).
        The wait is per batch: after a full batch of P goes, the rest wait again (their own time) unless a slot would
        idle; flushing them with it made a third of the extends one-row calls when continuations came in bursts.
        Waiting rows hold their park rows, so nothing waits while fewer than P park rows are free: a turn that ends
        meanwhile must find room, or its episode goes on by a prefill of its whole history."""
        short = [c.park >= 0 and len(c.feed) <= self.cfg.decode_feed_tokens for c in self._ready]
        fed = [c for c, s in zip(self._ready, short) if s]
        if fed:
            self._ready = [c for c, s in zip(self._ready, short) if not s]
            for c in fed:
                c.target.episode.add_observation(c.feed[1:])
            self._queue.extendleft(reversed([Queued(Fed(c.park, c.feed), -1, c.target) for c in fed]))
        while self._ready:
            if len(self._ready) < self.P and (self._queue or self._in_flight >= self.B) \
                    and len(self._free_park) >= self.P \
                    and time.monotonic() - self._ready[0].ready_at < self.cfg.extend_wait_s:
                return
            batch, self._ready = self._ready[: self.P], self._ready[self.P :]
            with self._lock:
                params, version = self.params, self.version
            parked = [c for c in batch if c.park >= 0]
            entries = []
            if parked:
                t0 = time.perf_counter()
                state = self._extend_parked(params, version, [c.park for c in parked], [c.feed for c in parked])
                jax.block_until_ready(state.kv)
                self.stats.extend_time += time.perf_counter() - t0
                self.stats.extend_calls += 1
                self.stats.extend_rows += len(parked)
                for i, c in enumerate(parked):
                    c.target.episode.add_observation(c.feed[1:])
                    self._release(c.park)
                    entries.append(Queued(state, i, c.target))
            rest = [c for c in batch if c.park < 0]
            if rest:
                self.stats.parked_full += len(rest)
                for c in rest:
                    c.target.episode.add_observation(c.feed[1:])
                state = self.prefill([c.target.episode.history(c.group.rollout.prompt_tokens) for c in rest])
                entries += [Queued(state, i, c.target) for i, c in enumerate(rest)]
            self._queue.extendleft(reversed(entries))

    def _extend_parked(self, params: Any, version: int, parks: Sequence[int], feeds: Sequence[np.ndarray]) -> Any:
        """One `extend` call: park rows `parks` continued by `feeds` (each the turn's last sampled token, then the
        observation). Rows come in rungs of `extend_rows`; the feed but its last token is padded to an
        `extend_buckets` width, and the last token is passed apart (it is fed by the first decode step)."""
        rows = self.extend_rows(len(parks))
        toks, lens = self._padded([f[:-1] for f in feeds], rows, self.extend_min_bucket())
        idx = np.full((rows,), -1, np.int32)
        idx[: len(parks)] = parks
        last = np.zeros((rows,), np.int32)
        last[: len(feeds)] = [f[-1] for f in feeds]
        return self._run(self._extend, idx, toks, lens, last, np.int32(version), device=(params, self._park))
