"""One inference replica: bucketed prefill, a jitted decode loop, and continuous batching on the host.

Compiled programs:
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
from asyncrl.inference.forcing import force_end_of_think, force_eos
from asyncrl.inference.rollout import Completion, PromptRef, Rollout
from asyncrl.inference.sampling import sample
from asyncrl.inference.state import DecodeState, FinishedRow, deactivate_row, insert_row
from asyncrl.models import params as params_lib
from asyncrl.models.kvcache import KVCache
from asyncrl.models.tokenizer import Tokenizer, bucket_length
from asyncrl.models.transformer import Model

log = logging.getLogger(__name__)


@dataclass
class Request:
    """A prompt to sample `n` times. `prompt` rides along into the Rollout."""

    tokens: Sequence[int]
    n: int
    prompt: PromptRef | None = None
    is_eval: bool = False
    uid: int | None = None  # seeds this prompt's samples (with the engine seed); None = an engine counter


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


class Engine:
    """A replica over `mesh` (None = default device). Thread-safe for `set_params` vs. the decode thread."""

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
        self.model, self.cfg, self.tokenizer, self.mesh, self.name = model, cfg, tokenizer, mesh, name
        self.eos_id = eos_id if eos_id is not None else tokenizer.eos_id  # type: ignore[union-attr]
        self.pad_id = tokenizer.pad_id if tokenizer is not None else pad_id
        self.S = cfg.max_seq_len
        self.B = cfg.max_decode_batch_size
        self.P = cfg.max_prefill_prompts
        self.kv_dtype = jnp.dtype(cfg.kv_cache_dtype)
        self.phrase: list[int] | None = None
        if cfg.reasoning_budget is not None:
            self.phrase = self._think_phrase()
        self._lock = threading.Lock()
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        self._cpu = all(d.platform == "cpu" for d in devices)
        self.params = self._prepare(params)
        self.version = version
        self.between_loops: Callable[[], None] = lambda: None
        self.stats = EngineStats()
        self._slot_counter = 0
        self._uid_counter = 0
        self._slots: dict[int, tuple[_Group, int]] = {}
        self._in_flight = 0
        self._state: DecodeState | None = None
        self._pending_rows: list[FinishedRow] = []
        self._seed = seed
        self._substitute = substitute
        # Pinned output shardings keep the donated state's layout fixed across calls (no silent relayouts).
        state_sh = self.state_shardings(self.B)
        self._decode = jax.jit(
            self._decode_and_swap, donate_argnums=(1,),
            out_shardings=None if state_sh is None else (state_sh, None),
        )
        self._prefill = jax.jit(self._prefill_fn, out_shardings=self.state_shardings(self.P, split_rows=False))

    # ---- params ---------------------------------------------------------------------------------------------

    def set_params(self, params: Any, version: int) -> None:
        """Swap weights; rows in flight continue with the new ones (their versions record the boundary)."""
        params = self._prepare(params)
        with self._lock:
            self.params, self.version = params, version

    def _prepare(self, params: Any) -> Any:
        """The weights as this replica decodes with them. On the CPU, bf16/f16 leaves become f32 once per weight
        sync: XLA:CPU has no fast half-precision matmul and would otherwise convert every layer's weights on
        every step. Other backends decode with the trainer's tree as it is."""
        if params is None or not self._cpu:
            return params
        if all(x.dtype not in (jnp.bfloat16, jnp.float16) for x in jax.tree.leaves(params)):
            return params
        cast = jax.jit(lambda p: jax.tree.map(
            lambda x: x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x, p))
        if self.mesh is None:
            return cast(params)
        with jax.set_mesh(self.mesh):
            return cast(params)

    def _think_phrase(self) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("inference.reasoning_budget needs a tokenizer to encode inference.think_phrase")
        ids = self.tokenizer.encode(self.cfg.think_phrase)
        eot = self.tokenizer.end_of_think_id
        if eot is None or not ids or ids[-1] != eot:
            raise ValueError(
                f"inference.think_phrase={self.cfg.think_phrase!r} must end with the tokenizer's end-of-think token"
                f" (id {eot}); this tokenizer has {'none' if eot is None else 'a different last token'}"
            )
        if len(ids) > self.cfg.reasoning_budget:  # type: ignore[operator]
            raise ValueError(f"inference.think_phrase is {len(ids)} tokens, longer than inference.reasoning_budget")
        return ids

    # ---- shardings ------------------------------------------------------------------------------------------

    def _data_spec(self) -> Any:
        rules = self.model.rules
        if self.mesh is None or rules is None:
            return None
        axes = tuple(a for a in rules.mesh_axes("batch") if a in self.mesh.axis_names)
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    def state_shardings(self, rows: int, split_rows: bool = True) -> DecodeState | None:
        """Layouts of a state with `rows` rows. The decode batch splits rows over the data axis; a prefill batch
        (split_rows=False) is replicated over it so any device can copy any prompt row locally."""
        if self.mesh is None:
            return None
        m, b = self.mesh, (self._data_spec() if split_rows else None)
        kv = self.model.kv_cache_sharding(m, rows, self.S, self.kv_dtype)
        if not split_rows:
            kv = jax.tree.map(lambda ns: NamedSharding(m, P(*[None if i == 1 else e for i, e in enumerate(ns.spec)])), kv)
            kv.length = NamedSharding(m, P(None))
        ns = lambda *spec: NamedSharding(m, P(*spec))  # noqa: E731
        return DecodeState(
            next_token=ns(b), kv=kv, key=ns(), row_key=ns(b, None), tokens=ns(b, None), logprobs=ns(b, None), forced=ns(b, None),
            versions=ns(b, None), prompt_len=ns(b), limit=ns(b), slot=ns(b), active=ns(b), stop=ns(b), end_of_think=ns(b),
            steps=ns(),
        )

    # ---- compiled functions ---------------------------------------------------------------------------------

    def _empty(self, rows: int, key: jax.Array, split_rows: bool = True) -> DecodeState:
        c = self.model.cfg
        kv_shape = (c.num_layers, rows, c.num_kv_heads, self.S, c.head_dim)
        z = jnp.zeros(kv_shape, self.kv_dtype)
        state = DecodeState(
            next_token=jnp.zeros((rows,), jnp.int32),
            kv=KVCache(k=z, v=z, length=jnp.zeros((rows,), jnp.int32)),
            key=key,
            row_key=jnp.zeros((rows, 2), jnp.uint32),
            tokens=jnp.full((rows, self.S), self.pad_id, jnp.int32),
            logprobs=jnp.zeros((rows, self.S), jnp.float32),
            forced=jnp.zeros((rows, self.S), jnp.bool_),
            versions=jnp.zeros((rows, self.S), jnp.int32),
            prompt_len=jnp.zeros((rows,), jnp.int32),
            limit=jnp.full((rows,), self.S, jnp.int32),
            slot=jnp.full((rows,), -1, jnp.int32),
            active=jnp.zeros((rows,), jnp.bool_),
            stop=jnp.zeros((rows,), jnp.bool_),
            end_of_think=jnp.zeros((rows,), jnp.bool_),
            steps=jnp.zeros((), jnp.int32),
        )
        sh = self.state_shardings(rows, split_rows) if self.mesh is not None else None
        if sh is not None:  # created directly in the target layout (no replicated intermediate)
            state = jax.tree.map(lambda x, s: jax.sharding.reshard(x, s.spec), state, sh)
        return state

    def _prefill_fn(self, params: Any, tokens: jax.Array, lens: jax.Array) -> DecodeState:
        """tokens [P, W] right-padded prompts. Caches all but the last prompt token, which becomes next_token.
        No LM head: the first sampled token comes from the first decode step."""
        with jax.named_scope("prefill"):
            rows, width = tokens.shape
            state = self._empty(rows, jnp.zeros((2,), jnp.uint32), split_rows=False)
            kv = state.kv
            _, kv = self.model.prefill(params, tokens, jnp.maximum(lens - 1, 0), kv)
            last = jnp.take_along_axis(tokens, jnp.maximum(lens - 1, 0)[:, None], axis=1)[:, 0]
            out = jax.lax.dynamic_update_slice_in_dim(state.tokens, tokens, 0, axis=1)
            state.kv, state.next_token, state.tokens, state.prompt_len = kv, last, out, lens
            if self.cfg.max_new_tokens is not None:  # +1: the forced EOS slot after max_new_tokens sampled ones
                state.limit = jnp.minimum(lens + self.cfg.max_new_tokens + 1, self.S)
            return state

    def _decode_step(self, params: Any, s: DecodeState, version: jax.Array) -> DecodeState:
        cfg = self.cfg
        live = s.active & ~s.stop
        with jax.named_scope("fwd_pass"):
            logits, kv = self.model.apply(params, s.next_token[:, None], live.astype(jnp.int32), s.kv)
        index = s.kv.length + 1  # where the new token goes (the fed token sits at kv.length)
        with jax.named_scope("sampling"):
            keys = jax.vmap(jax.random.fold_in)(s.row_key, index)
            tok, lp = sample(logits[:, 0], keys, cfg.temperature)
        with jax.named_scope("forcing"):
            forced = jnp.zeros_like(live)
            eot = s.end_of_think
            if self.phrase is not None:
                tok, lp, forced, eot = force_end_of_think(
                    tok, lp, eot, index, s.prompt_len, budget=cfg.reasoning_budget, phrase=self.phrase
                )
            tok, lp, forced, stop_now, _ = force_eos(tok, lp, forced, index, limit=s.limit, eos_id=self.eos_id)
        # A position mask instead of a scatter: elementwise, so it keeps the rows' layout under any sharding.
        # Dead rows match no position and keep their outputs.
        at = (jnp.arange(self.S)[None, :] == index[:, None]) & live[:, None]  # [B, S]
        put = lambda old, new: jnp.where(at, new[:, None].astype(old.dtype), old)  # noqa: E731
        return DecodeState(
            next_token=jnp.where(live, tok, s.next_token),
            kv=kv,
            key=s.key,
            row_key=s.row_key,
            tokens=put(s.tokens, tok),
            logprobs=put(s.logprobs, lp),
            forced=put(s.forced, forced),
            versions=put(s.versions, jnp.broadcast_to(version, tok.shape)),
            prompt_len=s.prompt_len,
            limit=s.limit,
            slot=s.slot,
            active=s.active,
            stop=s.stop | (live & stop_now),
            end_of_think=jnp.where(live, eot, s.end_of_think),
            steps=s.steps + 1,
        )

    def _decode_and_swap(
        self, params: Any, s: DecodeState, prefill: DecodeState, p: jax.Array, slot: jax.Array, version: jax.Array,
        uid: jax.Array, k: jax.Array, max_steps: jax.Array,
    ) -> tuple[DecodeState, FinishedRow]:
        want_insert = p >= 0
        row_key = jax.random.fold_in(jax.random.fold_in(s.key, uid), k)
        steps0 = s.steps

        def cond(s: DecodeState) -> jax.Array:
            has_free = jnp.any(~s.active)
            return (jnp.any(s.active) & ~jnp.any(s.active & s.stop) & ~(want_insert & has_free)
                    & (s.steps - steps0 < max_steps))

        with jax.named_scope("single_decode_loop"):
            s = jax.lax.while_loop(cond, lambda s: self._decode_step(params, s, version), s)
        done = s.active & s.stop
        # A free row is filled without extracting anything (the host counts on that); otherwise one stopped
        # row is extracted and, if a sample is queued, replaced.
        fill = want_insert & jnp.any(~s.active)
        any_done = ~fill & jnp.any(done)
        inserted = want_insert & (fill | any_done)  # False when the chunk ran out with every row still live
        row = jnp.where(any_done, jnp.argmax(done), jnp.argmax(~s.active)).astype(jnp.int32)
        sel = jnp.arange(done.shape[0]) == row  # [B]

        def take(x: jax.Array) -> jax.Array:
            # A masked reduction over rows rather than a dynamic slice: valid whatever the rows' sharding.
            m = sel.reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.any(m & x, axis=0) if x.dtype == jnp.bool_ else jnp.sum(jnp.where(m, x, 0), axis=0).astype(x.dtype)

        length = take(s.kv.length) + 1
        finished = FinishedRow(
            tokens=take(s.tokens), logprobs=take(s.logprobs), forced=take(s.forced), versions=take(s.versions),
            prompt_len=take(s.prompt_len), length=length, slot=jnp.where(any_done, take(s.slot), -1),
            hit_length=take(s.forced)[jnp.clip(length - 1, 0, self.S - 1)], steps=s.steps - steps0,
            end_of_think=take(s.end_of_think), inserted=inserted,
        )
        with jax.named_scope("sub_next_batch"):
            s = jax.lax.cond(
                inserted,
                lambda s: self._insert(s, prefill, p, row, slot, row_key),
                lambda s: jax.lax.cond(any_done, lambda s: deactivate_row(s, row), lambda s: s, s),
                s,
            )
        return s, finished

    def _insert(self, s: DecodeState, prefill: DecodeState, p: jax.Array, row: jax.Array, slot: jax.Array,
                row_key: jax.Array) -> DecodeState:
        spec = self._data_spec()
        if self.mesh is None or spec is None:
            return insert_row(s, prefill, p, row, slot, row_key)
        if self._substitute == "naive":
            # What XLA does when left alone (the blog's 75 ms case): gather every row of the state, substitute
            # everywhere, scatter back. Kept for the benchmark against the shard_map version.
            full = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), s)
            out = insert_row(full, prefill, p, row, slot, row_key)
            return jax.tree.map(lambda x, ns: jax.sharding.reshard(x, ns.spec), out, self.state_shardings(self.B))
        return self._insert_shard_map(s, prefill, p, row, slot, row_key)

    def _insert_shard_map(self, s, prefill, p, row, slot, row_key):
        """SPMD substitution that only touches the device holding `row` (the blog's fix: XLA's choice
        all-gathers the KV cache, substitutes everywhere and scatters back)."""
        mesh, spec = self.mesh, self._data_spec()
        axes = (spec,) if isinstance(spec, str) else tuple(spec)
        state_specs = jax.tree.map(lambda ns: ns.spec, self.state_shardings(self.B))
        prefill_specs = jax.tree.map(lambda ns: ns.spec, self.state_shardings(self.P, split_rows=False))

        def local(s_local, prefill_local, p, row, slot, row_key):
            b_local = s_local.next_token.shape[0]
            shard = jax.lax.axis_index(axes)
            start = shard * b_local
            here = (row >= start) & (row < start + b_local)
            return jax.lax.cond(
                here, lambda s: insert_row(s, prefill_local, p, row - start, slot, row_key), lambda s: s, s_local
            )

        return jax.shard_map(
            local, mesh=mesh, in_specs=(state_specs, prefill_specs, P(), P(), P(), P()), out_specs=state_specs,
        )(s, prefill, p, row, slot, row_key)

    # ---- ahead-of-time compilation -------------------------------------------------------------------------
    # The programs above, lowered from abstract values only: what `launch.py aot` compiles for a TPU slice.

    def abstract_params(self) -> Any:
        """ShapeDtypeStructs of the weights this replica decodes with (`inference.params_dtype`, its layout)."""
        dtype = jnp.dtype(self.cfg.params_dtype)
        shapes = params_lib.shapes(self.model.cfg, dtype)
        if self.mesh is None:
            return shapes
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                            self.model.param_shardings(self.mesh, dtype))

    def abstract_state(self, rows: int | None = None, split_rows: bool = True) -> DecodeState:
        """ShapeDtypeStructs of a decode state (`rows` = max_decode_batch_size) or, with split_rows=False, of a
        prefill batch, on the layouts the compiled programs pin."""
        rows = self.B if rows is None else rows
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        if self.mesh is None:
            return jax.eval_shape(lambda k: self._empty(rows, k, split_rows), key)
        with jax.set_mesh(self.mesh):
            shapes = jax.eval_shape(lambda k: self._empty(rows, k, split_rows), key)
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                            self.state_shardings(rows, split_rows))

    def prefill_buckets(self) -> list[int]:
        """Every prompt width `prefill` can compile (prompts are 1 .. max_seq_len - 1 tokens)."""
        return sorted({bucket_length(n, self.cfg.min_prefill_bucket, self.S) for n in range(1, self.S)})

    def _scalar(self, dtype: Any) -> jax.ShapeDtypeStruct:
        sh = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.ShapeDtypeStruct((), dtype, sharding=sh)

    def lower_decode(self) -> jax.stages.Lowered:
        """The decode loop with row substitution (`decode_and_swap`), lowered on abstract inputs."""
        i32 = lambda: self._scalar(jnp.int32)  # noqa: E731
        args = (self.abstract_params(), self.abstract_state(), self.abstract_state(self.P, split_rows=False),
                i32(), i32(), i32(), self._scalar(jnp.uint32), i32(), i32())
        return self._lower(self._decode, args)

    def lower_prefill(self, bucket: int) -> jax.stages.Lowered:
        """The prefill program for prompts padded to `bucket` tokens, lowered on abstract inputs."""
        sh = None if self.mesh is None else NamedSharding(self.mesh, P())
        args = (self.abstract_params(), jax.ShapeDtypeStruct((self.P, bucket), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((self.P,), jnp.int32, sharding=sh))
        return self._lower(self._prefill, args)

    def _lower(self, fn: Any, args: tuple) -> jax.stages.Lowered:
        if self.mesh is None:
            return fn.lower(*args)
        with jax.set_mesh(self.mesh):
            return fn.lower(*args)

    # ---- host loop ------------------------------------------------------------------------------------------

    def _new_state(self) -> DecodeState:
        key = jax.random.PRNGKey(self._seed)
        sh = self.state_shardings(self.B)
        if self.mesh is None:
            return jax.jit(lambda k: self._empty(self.B, k))(key)
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda k: self._empty(self.B, k), out_shardings=sh)(key)

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
            params = self.params
        t0 = time.perf_counter()
        if self.mesh is not None:
            rep = NamedSharding(self.mesh, P())
            with jax.set_mesh(self.mesh):  # tracing needs the mesh for explicit-sharding rules (thread-local)
                state = self._prefill(params, jax.device_put(toks, rep), jax.device_put(lens, rep))
        else:
            state = self._prefill(params, jnp.asarray(toks), jnp.asarray(lens))
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
                uid = r.uid if r.uid is not None else self._uid_counter
                rollout = Rollout(prompt=r.prompt, prompt_tokens=np.asarray(r.tokens, np.int32), group_size=r.n,
                                  is_eval=r.is_eval, uid=uid, worker=self.name)
                self._uid_counter += 1
                g = _Group(rollout, r.n, [None] * r.n)
                queue.extend((i, g, k) for k in range(r.n))
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
        uid, k = (target[0].rollout.uid, target[1]) if target is not None else (0, 0)
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
                versions=np.asarray(r.versions[pl:n], np.int32), text=text,
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
