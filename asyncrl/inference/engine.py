"""One inference replica: bucketed prefill, a jitted decode loop, and continuous batching on the host, with the
turns of multi-turn episodes.

The engine is made of parts, each in its own module:
- `layout.Layout`: sizes, shardings and the empty state of the replica;
- `programs.DecodePrograms` and `parking.ParkPrograms`: the compiled device programs, lowered abstractly by
  `lowering.AbstractPrograms`;
- `weights.Weights`: the params and their version, swapped under a lock;
- `parking.ParkStore`: the park store's cache and its free rows;
- `scheduler.Scheduler`: the decode rows, their slots and the queue of samples waiting for one;
- `turns.EpisodeDriver`: the episodes, their environment steps and their continuations.
They talk through small dataclasses (`episodes.Queued`, `Stepping`, `Continuation`, `scheduler.Outcome`).

Compiled programs:
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

import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.episodes import Episode, Group, Queued, Target
from asyncrl.inference.forcing import think_phrase
from asyncrl.inference.layout import Layout
from asyncrl.inference.lowering import AbstractPrograms
from asyncrl.inference.parking import ParkPrograms, ParkStore
from asyncrl.inference.programs import DecodePrograms
from asyncrl.inference.scheduler import Scheduler
from asyncrl.inference.state import DecodeState
from asyncrl.inference.stats import EngineStats
from asyncrl.inference.turns import EpisodeDriver
from asyncrl.inference.weights import Weights, place_params
from asyncrl.models.lora import AdapterSpec
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.models.transformer import Model
from asyncrl.rollout import Environment, Prompt, Rollout

__all__ = ["Engine", "EngineStats", "Request", "place_params"]


@dataclass
class Request:
    """Work for the engine: `prompt.n` samples of these token ids. The `Prompt` rides along into the Rollout, and
    its `uid` seeds the samples (with the engine seed). `envs`: one environment per sample, opened already (their
    `reset` gave `tokens`); None generates without one (no reward)."""

    prompt: Prompt
    tokens: Sequence[int]
    envs: Sequence[Environment] | None = None


class Engine:
    """A replica over `mesh` (None = default device): its parts (see the module's docstring) and the host loop of
    continuous batching over them. Thread-safe for `set_params` vs. the decode thread."""

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
        record_routes: bool = False,
    ):
        """`stop`: token sequences that end a model turn like EOS does (a tool call's closing tag); the sequence's
        tokens stay in the completion as sampled. `record_routes` (train.moe.router_replay, a MoE model): each
        completion carries its tokens' experts (`Completion.routes`)."""
        self.cfg, self.tokenizer, self.name = cfg, tokenizer, name
        self.eos_id = eos_id if eos_id is not None else tokenizer.eos_id  # type: ignore[union-attr]
        self.pad_id = tokenizer.pad_id if tokenizer is not None else pad_id
        self.layout = lay = Layout(model, cfg, mesh, self.pad_id, record_routes)
        self.model, self.mesh, self.cpu = lay.model, mesh, lay.cpu
        self.S, self.B, self.P, self.Q, self.F = lay.S, lay.B, lay.P, lay.Q, lay.F
        phrase = think_phrase(tokenizer, cfg.think_phrase, cfg.reasoning_budget) \
            if cfg.reasoning_budget is not None else None
        self.parking = ParkPrograms(lay) if self.Q else None
        self.programs = DecodePrograms(lay, self.parking, eos_id=self.eos_id, seed=seed, substitute=substitute,
                                       stop=stop, phrase=phrase)
        self.stop = self.programs.stop
        self.abstract = AbstractPrograms(lay, self.programs, self.parking)
        self.weights = Weights(lay, params, version)
        self.stats = EngineStats()
        self.store = ParkStore(self.parking) if self.parking is not None else None
        self.scheduler = Scheduler(lay, self.programs, self.weights, self.stats, self.store)
        self.driver = EpisodeDriver(cfg, name, self.stats, self.scheduler, self.store, tokenizer, self.eos_id,
                                    self.stop)
        self.between_loops: Callable[[], None] = lambda: None

    # ---- params ---------------------------------------------------------------------------------------------

    @property
    def params(self) -> Any:
        return self.weights.params

    @property
    def version(self) -> int:
        return self.weights.version

    def set_params(self, params: Any, version: int) -> None:
        """Swap weights, given in any placement (the hop chain's delivery: a zero-copy view of it where it already
        sits on this replica's devices); rows in flight continue with the new ones (their versions record the
        boundary)."""
        self.weights.set(params, version)

    # ---- host loop ------------------------------------------------------------------------------------------

    def prefill(self, prompts: Sequence[Sequence[int]]) -> DecodeState:
        return self.scheduler.prefill(prompts)

    def generate(self, requests: Sequence[Request], drain: bool = True,
                 on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Sample every request `n` times, each sample in its own environment. With drain=False, rows still in
        flight (or waiting on their environments) when the queue empties are carried into the next call; finished
        groups are returned (and passed to `on_group`) as they complete."""
        done: list[Rollout] = []

        def emit(r: Rollout) -> None:
            done.append(r)
            if on_group is not None:
                on_group(r)

        self.driver.emit = emit
        t0 = time.perf_counter()
        if self.scheduler.state is None:
            self.scheduler.state = self.programs.new_state()
            if self.store is not None:
                self.store.kv = self.parking.new_store()  # type: ignore[union-attr]
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
                self.scheduler.queue.extend(Queued(prefill, i, Target(g, k)) for k in range(n))
            self._pump()
        if drain:
            while self.busy:
                self._advance()
        self.stats.engine_time += time.perf_counter() - t0
        return done

    @property
    def in_flight(self) -> int:
        """Rows holding a live sample (carried across `generate(drain=False)` calls)."""
        return self.scheduler.in_flight

    @property
    def busy(self) -> bool:
        """Anything not yet emitted: rows in flight or queued, episodes stepping or about to continue."""
        return bool(self.scheduler.in_flight or self.scheduler.queue or self.driver.busy)

    def advance(self, on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Move episodes on without new prompts: continue those whose environment answered, finish one in-flight row,
        or wait a moment for an environment. Keeps rows moving when the prompt queue is empty."""
        done: list[Rollout] = []
        self.driver.emit = lambda r: (done.append(r), on_group(r) if on_group else None)
        t0 = time.perf_counter()
        self._advance()
        self.stats.engine_time += time.perf_counter() - t0
        return done

    def _advance(self) -> None:
        self.driver.poll()
        self.driver.launch_ready()
        if self.scheduler.queue:
            self._pump()
        elif self.scheduler.in_flight > 0 and self.scheduler.state is not None:
            self._call(None, -1, None)
        elif self.driver.stepping:
            wait_futures([s.future for s in self.driver.stepping], timeout=0.02, return_when="FIRST_COMPLETED")
            self.driver.poll()

    def _pump(self) -> None:
        """Insert the queued rows (continuations first), decoding until a row is free for each."""
        while self.scheduler.queue:
            self.driver.poll()
            self.driver.launch_ready()
            q = self.scheduler.queue.popleft()
            while not self._call(q.source, q.row, q.target):  # a chunk ended before a row was free: decode on
                self.driver.poll()

    def _call(self, source: Any, p: int, target: Target | None) -> bool:
        """One decode chunk; returns whether `target` was inserted (always True without a target). A row that came
        out is collected at once: its environment steps (and its group can be emitted) while decoding goes on;
        holding it until the current prompt batch is all inserted would make it a straggler."""
        self.between_loops()
        out = self.scheduler.call(source, p, target)
        if out.row is not None:
            park = -1
            # Its cache to the park store while its environment steps, unless no turn can follow this one.
            if self.store is not None and self.store.free and self.driver.parks(out.target):
                park = self.store.take()
                t1 = time.perf_counter()
                self.store.park(self.scheduler.state.kv, int(out.row.row), park)
                self.stats.park_time += time.perf_counter() - t1
            self.driver.collect(out.row, out.target, park)
        return out.inserted

    # ---- the programs, lowered abstractly (`launch.py aot`) -------------------------------------------------

    def prefill_buckets(self) -> list[int]:
        return self.layout.prefill_buckets()

    def extend_buckets(self) -> list[int]:
        return self.layout.extend_buckets()

    def extend_rows(self, n: int) -> int:
        return self.layout.extend_rows(n)

    def abstract_params(self) -> Any:
        return self.abstract.abstract_params()

    def abstract_state(self, rows: int | None = None, split_rows: bool = True) -> DecodeState:
        return self.abstract.abstract_state(rows, split_rows)

    def abstract_park(self) -> Any:
        return self.abstract.abstract_park()

    def abstract_lora(self, lora_cfg: AdapterSpec) -> Any:
        return self.abstract.abstract_lora(lora_cfg)

    def abstract_params_with_lora(self, lora_cfg: AdapterSpec) -> Any:
        return self.abstract.abstract_params_with_lora(lora_cfg)

    def lower_prefill(self, bucket: int) -> jax.stages.Lowered:
        return self.abstract.lower_prefill(bucket)

    def lower_decode(self, params: Any = None) -> jax.stages.Lowered:
        return self.abstract.lower_decode(params)

    def lower_decode_keeping_base(self) -> jax.stages.Lowered:
        return self.abstract.lower_decode_keeping_base()

    def lower_lora_merge(self, lora_cfg: AdapterSpec) -> jax.stages.Lowered:
        return self.abstract.lower_lora_merge(lora_cfg)

    def lower_park(self) -> jax.stages.Lowered:
        return self.abstract.lower_park()

    def lower_extend(self, bucket: int, rows: int | None = None) -> jax.stages.Lowered:
        return self.abstract.lower_extend(bucket, rows)
