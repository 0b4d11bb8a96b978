"""One inference replica: bucketed prefill, a jitted decode loop, and continuous batching on the host, with the
turns of multi-turn episodes.

Compiled programs (`programs.py`, which the engine extends with the host side):
- `prefill`, memoized per power-of-two prompt bucket (at most log2(max_seq_len) programs);
- `decode_and_swap`, compiled once: fills a free slot with the next queued (prompt, sample) row, runs decode steps
  in a `lax.while_loop` until some live row stops, takes that row out, and puts the queued row in its place if no
  slot was free. The state is donated. The loop also
  returns after `inference.decode_chunk_steps` steps with nothing finished, so the host gets control back (and
  a pending weight sync its chance) at least that often; an insert that did not happen is retried.

When a prompt batch's queue runs dry the in-flight rows are *not* drained: they are carried into the next
prompt batch (`generate(..., drain=False)`), so there is no straggler tail. Between decode loops the engine
calls `between_loops()`, the hook where the orchestration swaps in new weights (`set_params`).

Episodes. Each sample runs in its environment (`Request.envs`, one per sample; none: plain generation). A row
that ends its turn leaves the decode batch at once; its environment steps on a worker thread
(`inference.env_workers`) while the other rows decode. A single-turn environment grades the answer and ends the
episode. Otherwise its observation comes back and the row rejoins the decode batch ahead of new prompts from its
saved cache (the park store): a short continuation goes straight into a free slot, whose decode steps feed its
tokens one a step beside the other rows (`inference.decode_feed_tokens`); a longer one is appended to the saved cache
by `extend` first. A group is emitted once every episode in it has ended (`episodes.py`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.episodes import Continuation, Episode, Fed, Group, Queued, Stepping, Target
from asyncrl.inference.layout import cpu_decode_layout
from asyncrl.inference.programs import DecodePrograms
from asyncrl.inference.state import DecodeState, FinishedRow, unpack_row
from asyncrl.inference.turns import EpisodeDriver
from asyncrl.models import dense
from asyncrl.models.tokenizer import Tokenizer, bucket_length
from asyncrl.models.transformer import Model
from asyncrl.rollout import Environment, Prompt, Rollout, Turn

log = logging.getLogger(__name__)


def place_params(params: Any, shardings: Any) -> Any:
    """Put params on a replica's layout. Where a leaf already holds a full copy on each target device (what the
    weight-sync hop chain delivers), the replica's array is a zero-copy view of those buffers."""

    def one(x: jax.Array, sh: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and all(e is None for e in sh.spec):
            by_dev = {s.device: s.data for s in x.addressable_shards if s.data.shape == x.shape}
            targets = list(sh.mesh.devices.flat)
            if all(d in by_dev for d in targets):
                return jax.make_array_from_single_device_arrays(x.shape, sh, [by_dev[d] for d in targets])
        return jax.device_put(x, sh)

    return jax.tree.map(one, params, shardings)


@dataclass
class Request:
    """Work for the engine: `prompt.n` samples of these token ids. The `Prompt` rides along into the Rollout, and
    its `uid` seeds the samples (with the engine seed). `envs`: one environment per sample, opened already (their
    `reset` gave `tokens`); None generates without one (no reward)."""

    prompt: Prompt
    tokens: Sequence[int]
    envs: Sequence[Environment] | None = None


@dataclass
class EngineStats:
    decode_steps: int = 0
    calls: int = 0
    finished: int = 0
    generated_tokens: int = 0
    decode_time: float = 0.0  # seconds of decode loops, dispatch to device completion
    prefill_time: float = 0.0  # seconds of prefills, dispatch to device completion
    prefill_calls: int = 0
    engine_time: float = 0.0  # wall seconds inside generate / advance: the device calls and the host work between
    extend_time: float = 0.0  # seconds of extends (multi-turn continuations)
    env_steps: int = 0
    env_time: float = 0.0  # seconds environments spent in their steps (on worker threads)
    parked_full: int = 0  # continuations whose cache did not fit the park store (re-prefilled)
    slot_steps: int = 0  # decode steps x rows live in them (occupancy: slot_steps / (decode_steps x batch)); the
    # row-steps that fed an observation token rather than sampling one are `fed_tokens`
    slot_time: float = 0.0  # decode seconds x rows live in them
    fed_tokens: int = 0  # observation tokens fed by decode steps (multi-turn continuations)
    park_time: float = 0.0  # seconds of park calls (a row's cache into the park store)
    extend_calls: int = 0
    extend_rows: int = 0  # continuations extended (over extend_calls: rows a call)
    detokenize_time: float = 0.0  # seconds collecting finished rows on the host (detokenizing them)


class Engine(EpisodeDriver, DecodePrograms):
    """A replica over `mesh` (None = default device): the host side of continuous batching over the compiled
    programs of `DecodePrograms`. Thread-safe for `set_params` vs. the decode thread."""

    def __init__(
        self,
        model: Model,
        params: Any,
        cfg: InferenceConfig,
        tokenizer: Tokenizer | None,
        *,
        eos_id: int | None = None,
        pad_id: int = 0,
        mesh: Mesh | None = None,
        seed: int = 0,
        version: int = 0,
        name: str = "replica0",
        substitute: str = "auto",
        stop: Sequence[Sequence[int]] = (),
    ):
        super().__init__(model, cfg, tokenizer, eos_id=eos_id, pad_id=pad_id, mesh=mesh, seed=seed,
                         substitute=substitute, stop=stop)
        self.name = name
        self._lock = threading.Lock()
        self.params = self._prepare(self._place(params))
        self.version = version
        self.between_loops: Callable[[], None] = lambda: None
        self.stats = EngineStats()
        self._slot_counter = 0
        self._slots: dict[int, Target] = {}
        self._in_flight = 0
        self._state: DecodeState | None = None
        self._queue: collections.deque[Queued] = collections.deque()
        self._stepping: list[Stepping] = []
        self._ready: list[Continuation] = []
        self._park: Any = None
        self._free_park: list[int] = list(range(self.Q))[::-1]
        self._pool: ThreadPoolExecutor | None = None
        self._emit: Callable[[Rollout], Any] | None = None

    # ---- params ---------------------------------------------------------------------------------------------

    def set_params(self, params: Any, version: int) -> None:
        """Swap weights, given in any placement (the hop chain's delivery: a zero-copy view of it where it already
        sits on this replica's devices); rows in flight continue with the new ones (their versions record the
        boundary)."""
        params = self._prepare(self._place(params))
        with self._lock:
            self.params, self.version = params, version

    def _place(self, params: Any) -> Any:
        if params is None or self.mesh is None:
            return params
        return place_params(params, self.model.param_shardings(self.mesh))

    def _prepare(self, params: Any) -> Any:
        """The weights as this replica decodes with them, made once per weight sync. On the CPU:
        - bf16/f16 leaves become f32: XLA:CPU has no fast half-precision matmul and would otherwise convert every
          layer's weights on every step;
        - the stacked layers are split into per-layer arrays (`params.unstack_layers`): a scan over stacked
          weights copies each layer's slice before its matmuls on every step, a second pass over all weights;
        - each matrix is stored transposed, output dims first (`models/dense.py`): XLA:CPU's small-batch
          matmul is faster that way round.
        Other backends decode with the trainer's tree as it is (TPU fuses the slice into the matmul)."""
        if params is None or not self.cpu or dense.is_output_major(params):
            return params
        if self.mesh is None:
            return cpu_decode_layout(params)
        with jax.set_mesh(self.mesh):
            return cpu_decode_layout(params)

    # ---- host loop ------------------------------------------------------------------------------------------

    def prefill(self, prompts: Sequence[Sequence[int]]) -> DecodeState:
        if len(prompts) > self.P:
            raise ValueError(f"{len(prompts)} prompts > inference.max_prefill_prompts={self.P}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) < self.S:
                raise ValueError(f"prompt {i} has {len(p)} tokens; must be in [1, max_seq_len={self.S})")
        toks, lens = self._padded(prompts)
        with self._lock:
            params, version = self.params, np.int32(self.version)
        t0 = time.perf_counter()
        state = self._run(self._prefill, toks, lens, version, device=(params,))
        jax.block_until_ready(state.kv)
        self.stats.prefill_time += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        return state

    def _padded(self, rows: Sequence[Sequence[int]], n: int | None = None,
                min_bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[n (default P), bucket] right-padded ids and [n] lengths; unused rows are a 1-token dummy, never
        inserted."""
        n = self.P if n is None else n
        width = bucket_length(max(len(p) for p in rows), min_bucket or self.cfg.min_prefill_bucket, self.S)
        toks = np.full((n, width), self.pad_id, np.int32)
        lens = np.ones((n,), np.int32)
        for i, p in enumerate(rows):
            toks[i, : len(p)] = p
            lens[i] = len(p)
        return toks, lens

    def _run(self, fn: Any, *host: Any, device: tuple = ()) -> Any:
        """`fn(*device, *host)` with the host arrays placed replicated on this replica's mesh. Host values are
        numpy arrays and scalars, passed to the jitted call as they are (or put in one `device_put`): a `jnp.asarray`
        each cost 0.19 ms a decode call for its 7 scalars, on a 2-core CPU, where a zero-step call costs 0.5 ms."""
        if self.mesh is None:
            return fn(*device, *host)
        rep = NamedSharding(self.mesh, P())
        with jax.set_mesh(self.mesh):  # tracing needs the mesh for explicit-sharding rules (thread-local)
            return fn(*device, *jax.device_put(tuple(host), rep))

    def generate(self, requests: Sequence[Request], drain: bool = True, on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Sample every request `n` times, each sample in its own environment. With drain=False, rows still in
        flight (or waiting on their environments) when the queue empties are carried into the next call; finished
        groups are returned (and passed to `on_group`) as they complete."""
        done: list[Rollout] = []

        def emit(r: Rollout) -> None:
            done.append(r)
            if on_group is not None:
                on_group(r)

        self._emit = emit
        t0 = time.perf_counter()
        if self._state is None:
            self._state = self._new_state()
            if self.Q:
                self._park = self._new_park()
        for start in range(0, len(requests), self.P):
            chunk = requests[start : start + self.P]
            prefill = self.prefill([r.tokens for r in chunk])
            for i, r in enumerate(chunk):
                n = r.prompt.n
                envs = list(r.envs) if r.envs is not None else [None] * n
                if len(envs) != n:
                    raise ValueError(f"request for {r.prompt.id}: {len(envs)} environments for {n} samples")
                rollout = Rollout(prompt=r.prompt, prompt_tokens=np.asarray(r.tokens, np.int32), worker=self.name)
                g = Group(rollout, [Episode(env, len(r.tokens)) for env in envs])
                self._queue.extend(Queued(prefill, i, Target(g, k)) for k in range(n))
            self._pump()
        if drain:
            while self.busy:
                self._advance()
        self.stats.engine_time += time.perf_counter() - t0
        return done

    @property
    def in_flight(self) -> int:
        """Rows holding a live sample (carried across `generate(drain=False)` calls)."""
        return self._in_flight

    @property
    def busy(self) -> bool:
        """Anything not yet emitted: rows in flight or queued, episodes stepping or about to continue."""
        return bool(self._in_flight or self._queue or self._stepping or self._ready)

    def advance(self, on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Move episodes on without new prompts: continue those whose environment answered, finish one in-flight row,
        or wait a moment for an environment. Keeps rows moving when the prompt queue is empty."""
        done: list[Rollout] = []
        self._emit = lambda r: (done.append(r), on_group(r) if on_group else None)
        t0 = time.perf_counter()
        self._advance()
        self.stats.engine_time += time.perf_counter() - t0
        return done

    def _advance(self) -> None:
        self._poll_env()
        self._launch_ready()
        if self._queue:
            self._pump()
        elif self._in_flight > 0 and self._state is not None:
            self._call(None, -1, None)
        elif self._stepping:
            wait_futures([s.future for s in self._stepping], timeout=0.02, return_when="FIRST_COMPLETED")
            self._poll_env()

    def _pump(self) -> None:
        """Insert the queued rows (continuations first), decoding until a row is free for each."""
        while self._queue:
            self._poll_env()
            self._launch_ready()
            q = self._queue.popleft()
            while not self._call(q.source, q.row, q.target):  # a chunk ended before a row was free: decode on
                self._poll_env()

    def _call(self, prefill: DecodeState | Fed | None, p: int, target: Target | None) -> bool:
        """One decode chunk; returns whether `target` was inserted (always True without a target). A row that came
        out is collected at once: its environment steps (and its group can be emitted) while decoding goes on;
        holding it until the current prompt batch is all inserted would make it a straggler."""
        self.between_loops()
        with self._lock:
            params, version = self.params, self.version
        # A multi-turn engine never substitutes into the row it takes out: with the batch full, this call only
        # takes a row out (its cache is then parked by its own program) and the next call fills the free slot.
        defer = bool(self.Q) and target is not None and self._in_flight >= self.B
        slot = -1
        if target is not None and not defer:
            slot = self._slot_counter
            self._slot_counter += 1
            self._slots[slot] = target
        fed = prefill if isinstance(prefill, Fed) else None
        feed = np.zeros((self.F,), np.int32)
        if fed is not None:
            feed[: len(fed.feed)] = fed.feed
            prefill, p = None, 0
        if prefill is None:
            prefill = self._dummy_prefill()
        t0 = time.perf_counter()
        uid, k = (target.group.rollout.prompt.uid, target.k) if target is not None else (0, 0)
        scalars = (np.int32(-1 if defer else p), np.int32(slot), np.int32(version), np.uint32(uid & 0xFFFFFFFF),
                   np.int32(k), np.int32(self.cfg.decode_chunk_steps), np.bool_(bool(self._queue)),
                   np.int32(fed.park if fed is not None else -1), feed, np.int32(len(fed.feed) if fed else 0))
        # Rows decoding through this chunk: a row filled into a free slot joins at its start, a substituted one at
        # its end.
        live = self._in_flight + int(target is not None and not defer and self._in_flight < self.B)
        self._state, packed = self._run(self._decode, *scalars, device=(params, self._state, prefill, self._park))
        # Waiting for the row waits for the device to finish the chunk, so decode_time (and the
        # decode_tokens_per_s metric built on it) is device time, and `between_loops` runs on executed work.
        row = unpack_row(np.asarray(jax.device_get(packed)))
        inserted, out_slot, steps = row.inserted, row.slot, row.steps
        dt = time.perf_counter() - t0
        self.stats.decode_time += dt
        self.stats.calls += 1
        self.stats.decode_steps += int(steps)
        self.stats.slot_steps += live * int(steps)
        self.stats.slot_time += live * dt
        if target is not None and not defer and not inserted:
            del self._slots[slot]
        if fed is not None and not defer and bool(inserted):  # its cache is in a decode row now
            self._release(fed.park)
            self.stats.fed_tokens += len(fed.feed) - 1
        self._in_flight += int(bool(inserted))
        if int(out_slot) >= 0:  # a finished row came out
            self._in_flight -= 1
            park_at = -1
            ep = self._slots[int(out_slot)].episode
            # Its cache to the park store while its environment steps, unless no turn can follow this one.
            if self.Q and self._free_park and ep.env is not None and ep.turn + 1 < self.cfg.max_turns:
                park_at = self._free_park.pop()
                t1 = time.perf_counter()
                self._park = self._run(self._park_prog, row.row, np.int32(park_at),
                                       device=(self._state.kv, self._park))
                self.stats.park_time += time.perf_counter() - t1
            self._collect(row, park_at)
        return target is None or (not defer and bool(inserted))

    def _dummy_prefill(self) -> DecodeState:
        if not hasattr(self, "_dummy"):
            self._dummy = self.prefill([[self.pad_id]])
        return self._dummy

    def _collect(self, r: FinishedRow, park: int) -> None:
        """A finished row (on the host already, `park` the park row its cache went to or -1): a model turn of its
        episode, handed to the episode's environment (or, with none, the end of it)."""
        t0 = time.perf_counter()
        target = self._slots.pop(int(r.slot))
        ep = target.episode
        pl, n = int(r.prompt_len), int(r.length)
        toks = np.asarray(r.tokens[pl:n], np.int32)
        text = self.tokenizer.decode(toks[:-1] if len(toks) and toks[-1] == self.eos_id else toks) \
            if self.tokenizer else ""
        finish = "length" if bool(r.hit_length) else ("stop" if self._ends_with_stop(toks) else "eos")
        ep.add_turn(toks, np.asarray(r.logprobs[pl:n], np.float32), np.asarray(r.forced[pl:n], bool),
                    np.asarray(r.versions[pl:n], np.int32), text, finish, bool(r.end_of_think),
                    context_versions=r.versions[:pl])
        self.stats.finished += 1
        self.stats.generated_tokens += len(toks)
        if ep.env is None:
            self._release(park)
            ep.end(None)
            self._maybe_emit(target.group)
        else:
            last = ep.turn >= self.cfg.max_turns or n >= self.S - 1
            turn = Turn(toks, text, ep.turn - 1, finish, last)
            self._stepping.append(Stepping(self._step(ep, turn), target, park, last))
        self.stats.detokenize_time += time.perf_counter() - t0
        self._poll_env()

    def _ends_with_stop(self, toks: np.ndarray) -> bool:
        return any(len(toks) >= len(q) and tuple(toks[-len(q):]) == q for q in self.stop)
