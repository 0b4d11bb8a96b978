"""One inference replica: bucketed prefill, a jitted decode loop, and continuous batching on the host.

Compiled programs (`programs.py`, which the engine extends with the host side):
- `prefill`, memoized per power-of-two prompt bucket (at most log2(max_seq_len) programs);
- `decode_and_swap`, compiled once: runs decode steps in a `lax.while_loop` until some live row stops, takes
  that row out, and puts the next queued (prompt, sample) row in its place. The state is donated. The loop also
  returns after `inference.decode_chunk_steps` steps with nothing finished, so the host gets control back (and
  a pending weight sync its chance) at least that often; an insert that did not happen is retried.

When a prompt batch's queue runs dry the in-flight rows are *not* drained: they are carried into the next
prompt batch (`generate(..., drain=False)`), so there is no straggler tail. Between decode loops the engine
calls `between_loops()`, the hook where the orchestration swaps in new weights (`set_params`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.programs import DecodePrograms, cpu_decode_layout
from asyncrl.inference.state import DecodeState, FinishedRow
from asyncrl.models import dense
from asyncrl.models.tokenizer import Tokenizer, bucket_length
from asyncrl.models.transformer import Model
from asyncrl.rollout import Completion, Prompt, Rollout

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
    its `uid` seeds the samples (with the engine seed)."""

    prompt: Prompt
    tokens: Sequence[int]


@dataclass
class _Group:
    rollout: Rollout
    pending: int
    results: list = field(default_factory=list)  # completions by sample index, so output order is stable
    extracted: int = 0  # samples whose finished row has come off the device (collected or not)


@dataclass
class EngineStats:
    decode_steps: int = 0
    calls: int = 0
    finished: int = 0
    generated_tokens: int = 0
    decode_time: float = 0.0  # seconds of decode loops, dispatch to device completion
    prefill_time: float = 0.0  # seconds of prefills, dispatch to device completion
    extra: dict = field(default_factory=dict)


class Engine(DecodePrograms):
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
    ):
        super().__init__(model, cfg, tokenizer, eos_id=eos_id, pad_id=pad_id, mesh=mesh, seed=seed,
                         substitute=substitute)
        self.name = name
        self._lock = threading.Lock()
        self.params = self._prepare(self._place(params))
        self.version = version
        self.between_loops: Callable[[], None] = lambda: None
        self.stats = EngineStats()
        self._slot_counter = 0
        self._slots: dict[int, tuple[_Group, int]] = {}
        self._in_flight = 0
        self._state: DecodeState | None = None
        self._pending_rows: list[FinishedRow] = []

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
        width = bucket_length(max(len(p) for p in prompts), self.cfg.min_prefill_bucket, self.S)
        toks = np.full((self.P, width), self.pad_id, np.int32)
        lens = np.ones((self.P,), np.int32)  # unused rows: a 1-token dummy, never inserted
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
            lens[i] = len(p)
        with self._lock:
            params, version = self.params, np.int32(self.version)
        t0 = time.perf_counter()
        if self.mesh is not None:
            rep = NamedSharding(self.mesh, P())
            with jax.set_mesh(self.mesh):  # tracing needs the mesh for explicit-sharding rules (thread-local)
                state = self._prefill(params, jax.device_put(toks, rep), jax.device_put(lens, rep),
                                      jax.device_put(version, rep))
        else:
            state = self._prefill(params, jnp.asarray(toks), jnp.asarray(lens), version)
        jax.block_until_ready(state.kv)
        self.stats.prefill_time += time.perf_counter() - t0
        return state

    def generate(self, requests: Sequence[Request], drain: bool = True, on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Sample every request `n` times. With drain=False, rows still in flight when the queue empties are
        carried into the next call; finished groups are returned (and passed to `on_group`) as they complete."""
        done: list[Rollout] = []

        def emit(r: Rollout) -> None:
            done.append(r)
            if on_group is not None:
                on_group(r)

        if self._state is None:
            self._state = self._new_state()
        for start in range(0, len(requests), self.P):
            chunk = requests[start : start + self.P]
            prefill = self.prefill([r.tokens for r in chunk])
            queue: list[tuple[int, _Group, int]] = []
            for i, r in enumerate(chunk):
                rollout = Rollout(prompt=r.prompt, prompt_tokens=np.asarray(r.tokens, np.int32), worker=self.name)
                n = r.prompt.n
                g = _Group(rollout, n, [None] * n)
                queue.extend((i, g, k) for k in range(n))
            for i, g, k in queue:
                while not self._call(prefill, i, (g, k), emit):  # a chunk ended before a row was free: decode on
                    pass
            self._collect(emit)
        if drain:
            while self._in_flight > 0:
                self._call(None, -1, None, emit)
            self._collect(emit)
        return done

    @property
    def in_flight(self) -> int:
        """Rows holding a live sample (carried across `generate(drain=False)` calls)."""
        return self._in_flight

    def advance(self, on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Finish one in-flight row (no new prompt): keeps rows moving when the prompt queue is empty."""
        done: list[Rollout] = []
        if self._in_flight > 0 and self._state is not None:
            self._call(None, -1, None)
            self._collect(lambda r: (done.append(r), on_group(r) if on_group else None))
        return done

    def _call(self, prefill: DecodeState | None, p: int, target: tuple[_Group, int] | None,
              emit: Callable[[Rollout], Any] | None = None) -> bool:
        """One decode chunk; returns whether `target` was inserted (always True without a target). A group whose
        last row just came out is collected and emitted at once: holding it until the current prompt batch is
        all inserted would make it a straggler that the trainer waits for."""
        self.between_loops()
        with self._lock:
            params, version = self.params, self.version
        slot = -1
        if target is not None:
            slot = self._slot_counter
            self._slot_counter += 1
            self._slots[slot] = target
        if prefill is None:
            prefill = self._dummy_prefill()
        t0 = time.perf_counter()
        uid, k = (target[0].rollout.prompt.uid, target[1]) if target is not None else (0, 0)
        args = (params, self._state, prefill, np.int32(p), np.int32(slot), np.int32(version),
                np.uint32(uid & 0xFFFFFFFF), np.int32(k), np.int32(self.cfg.decode_chunk_steps))
        if self.mesh is None:
            self._state, row = self._decode(*args)
        else:
            with jax.set_mesh(self.mesh):
                self._state, row = self._decode(*args)
        # Waiting for the flags waits for the device to finish the chunk, so decode_time (and the
        # decode_tokens_per_s metric built on it) is device time, and `between_loops` runs on executed work.
        inserted, out_slot, steps = jax.device_get((row.inserted, row.slot, row.steps))
        self.stats.decode_time += time.perf_counter() - t0
        self.stats.calls += 1
        self.stats.decode_steps += int(steps)
        if target is not None and not inserted:
            del self._slots[slot]
        self._in_flight += int(bool(inserted))
        if int(out_slot) >= 0:  # a finished row came out
            self._in_flight -= 1
            self._pending_rows.append(row)
            group = self._slots[int(out_slot)][0]
            group.extracted += 1
            if emit is not None and group.extracted == len(group.results):
                self._collect(emit)
        return target is None or bool(inserted)

    def _dummy_prefill(self) -> DecodeState:
        if not hasattr(self, "_dummy"):
            self._dummy = self.prefill([[self.pad_id]])
        return self._dummy

    def _collect(self, emit: Callable[[Rollout], Any]) -> None:
        """Pull finished rows to the host in one transfer and assemble completed groups."""
        if not self._pending_rows:
            return
        rows = jax.device_get(self._pending_rows)
        self._pending_rows = []
        t0 = time.perf_counter()
        for r in rows:
            slot = int(r.slot)
            if slot < 0:
                continue
            group, k = self._slots.pop(slot)
            pl, n = int(r.prompt_len), int(r.length)
            toks = np.asarray(r.tokens[pl:n], np.int32)
            text = self.tokenizer.decode(toks[:-1] if len(toks) and toks[-1] == self.eos_id else toks) if self.tokenizer else ""
            comp = Completion(
                tokens=toks, logprobs=np.asarray(r.logprobs[pl:n], np.float32), forced=np.asarray(r.forced[pl:n], bool),
                versions=np.asarray(r.versions[pl:n], np.int32), prompt_version=int(r.versions[0]), text=text,
                finish_reason="length" if bool(r.hit_length) else "eos", ended_thinking=bool(r.end_of_think),
            )
            self.stats.finished += 1
            self.stats.generated_tokens += len(toks)
            group.results[k] = comp
            group.pending -= 1
            if group.pending == 0:
                group.rollout.completions = group.results
                emit(group.rollout)
        self.stats.extra["detokenize_time"] = self.stats.extra.get("detokenize_time", 0.0) + time.perf_counter() - t0
