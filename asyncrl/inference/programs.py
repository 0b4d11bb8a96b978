"""One replica's device programs: bucketed prefill and the decode loop with row substitution, their state
layouts, and their abstract (ahead-of-time) lowering. `engine.Engine` drives them from the host.

- `prefill`, memoized per power-of-two prompt bucket (at most log2(max_seq_len) programs);
- `decode_and_swap`, compiled once: puts the next queued (prompt, sample) row into a free slot, runs decode steps
  in a `lax.while_loop` until some live row stops (or `inference.decode_chunk_steps` pass), takes that row out,
  and puts the queued row in its place if no slot was free. The state is donated.

Multi-turn engines (`inference.max_turns` > 1) add two programs and a park store (`parking.py`), where a row that
ends its turn leaves its cache while its environment steps:
- `park`: copies the cache of the row `decode_and_swap` just took out into a free park row. A multi-turn engine
  runs `decode_and_swap` without a substitution when its batch is full (the row comes out and its slot stays free),
  parks the row, and fills the slot at the start of its next call. Parking inside `decode_and_swap` made XLA copy
  the whole decode cache on every call (measured: 36-45 ms a call on an 8 layer model, 0.4 ms for this program);
- `extend`, memoized per power-of-two width (from 4) and rung of rows (`extend_rows`), for continuations longer
  than `inference.decode_feed_tokens`: appends each one's tokens to its parked cache, and its rows go back into
  the decode batch like prefilled prompts.
A shorter continuation needs no program of its own: `decode_and_swap` fills the free slot straight from its park row
and its decode steps feed the continuation a token a step (`_decode_step`, "feeding"), while the other rows decode.
Single-turn engines compile exactly the two programs above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.forcing import force_end_of_think, force_eos
from asyncrl.inference.lowering import AbstractPrograms
from asyncrl.inference.parking import ParkPrograms
from asyncrl.inference.sampling import sample
from asyncrl.inference.state import DecodeState, FinishedRow, deactivate_row, insert_row, pack_row
from asyncrl.models import kvcache
from asyncrl.models.kvcache import KVCache
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.models.transformer import Model


class DecodePrograms(ParkPrograms, AbstractPrograms):
    """The jitted prefill and decode programs of one replica over `mesh` (None = default device)."""

    def __init__(self, model: Model, cfg: InferenceConfig, tokenizer: Tokenizer | None, *, eos_id: int | None = None,
                 pad_id: int = 0, mesh: Mesh | None = None, seed: int = 0, substitute: str = "auto",
                 stop: Sequence[Sequence[int]] = ()):
        """`stop`: token sequences that end a row's turn like EOS does (a tool call's closing tag); the sequence's
        tokens stay in the completion as sampled."""
        self.model, self.cfg, self.tokenizer, self.mesh = model, cfg, tokenizer, mesh
        self.eos_id = eos_id if eos_id is not None else tokenizer.eos_id  # type: ignore[union-attr]
        self.pad_id = tokenizer.pad_id if tokenizer is not None else pad_id
        self.S = cfg.max_seq_len
        self.B = cfg.max_decode_batch_size
        self.P = cfg.max_prefill_prompts
        self.Q = cfg.parked_rows
        self.F = max(cfg.decode_feed_tokens, 1)  # the feed vector a decode call takes (its width is fixed)
        self.kv_dtype = jnp.dtype(cfg.kv_cache_dtype)
        self.stop = [tuple(int(t) for t in seq) for seq in stop if len(seq)]
        self.phrase: list[int] | None = self._think_phrase() if cfg.reasoning_budget is not None else None
        self._seed = seed
        self._substitute = substitute
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        self.cpu = all(d.platform == "cpu" for d in devices)
        """On the CPU a replica decodes with per-layer weights and a per-layer KV cache (tuples of arrays, one per
        layer, looped over in Python): XLA:CPU copies a layer's slice out of stacked arrays before every matmul
        that reads it. Other backends keep the stacked trees and the layer scan (TPU reads the slice in place)."""
        flash = cfg.prefill_attention == "flash" or (cfg.prefill_attention == "auto" and devices[0].platform == "tpu")
        self.model = model = model.with_flash(flash)  # the prefill's (cached attention never uses the kernel)
        # Pinned output shardings keep the donated state's layout fixed across calls (no silent relayouts).
        state_sh = self.state_shardings(self.B)
        self._decode = jax.jit(
            self._decode_and_swap, donate_argnums=(1,),
            out_shardings=None if state_sh is None else (state_sh, None),
        )
        self._prefill = jax.jit(self._prefill_fn, out_shardings=self.state_shardings(self.P, split_rows=False))
        if self.Q:
            park_sh = self.park_shardings()
            self._park_prog = jax.jit(self._park_fn, donate_argnums=(1,), out_shardings=park_sh)
            self._extend = jax.jit(self._extend_fn, out_shardings=self.state_shardings(self.P, split_rows=False))

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
        kv = self.model.kv_cache_sharding(m, rows, self.S, self.kv_dtype, per_layer=self.cpu)
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
        state = DecodeState(
            next_token=jnp.zeros((rows,), jnp.int32),
            kv=kvcache.zeros(self.model.cfg, rows, self.S, self.kv_dtype, per_layer=self.cpu),
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

    def _prefill_fn(self, params: Any, tokens: jax.Array, lens: jax.Array, version: jax.Array) -> DecodeState:
        """tokens [P, W] right-padded prompts. Caches all but the last prompt token, which becomes next_token.
        No LM head: the first sampled token comes from the first decode step. The prompt positions of `versions`
        hold `version`, the weights that computed their cached keys and values: a weight swap before the first
        decode step must not hide that the prompt's cache is older than every sampled token."""
        with jax.named_scope("prefill"):
            rows, width = tokens.shape
            state = self._empty(rows, jnp.zeros((2,), jnp.uint32), split_rows=False)
            kv = state.kv
            _, kv = self.model.prefill(params, tokens, jnp.maximum(lens - 1, 0), kv)
            last = jnp.take_along_axis(tokens, jnp.maximum(lens - 1, 0)[:, None], axis=1)[:, 0]
            out = jax.lax.dynamic_update_slice_in_dim(state.tokens, tokens, 0, axis=1)
            state.kv, state.next_token, state.tokens, state.prompt_len = kv, last, out, lens
            prompt = jnp.arange(self.S)[None, :] < lens[:, None]  # [P, S]
            state.versions = jnp.where(prompt, version.astype(jnp.int32), state.versions)
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
            if self.stop:
                stop_now = stop_now | self._stop_hit(s, tok, index)
            if self.Q:
                # A continuation fed by decode steps: its observation sits in `tokens` below `prompt_len`, past
                # what its cache holds, and each step forces the next of those tokens instead of sampling (the
                # row's logits there are discarded, as a prefill's are). A row inserted from a prefill or an extend
                # starts at index == prompt_len and never feeds. Single-turn engines compile without this.
                feeding = index < s.prompt_len
                fed = jnp.take_along_axis(s.tokens, jnp.clip(index, 0, self.S - 1)[:, None], axis=1)[:, 0]
                tok = jnp.where(feeding, fed, tok)
                lp = jnp.where(feeding, 0.0, lp)
                forced = forced | feeding
                stop_now = stop_now & ~feeding
                eot = jnp.where(feeding, s.end_of_think, eot)
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

    def _stop_hit(self, s: DecodeState, tok: jax.Array, index: jax.Array) -> jax.Array:
        """[B] bool: the token just sampled at `index` completes one of the stop sequences, all of whose tokens lie
        past the row's prompt (a turn's own tokens, never the history it was given)."""
        L = max(len(q) for q in self.stop)
        seqs = jnp.asarray([[-1] * (L - len(q)) + list(q) for q in self.stop], jnp.int32)  # [J, L], left-padded
        lens = jnp.asarray([len(q) for q in self.stop], jnp.int32)  # [J]
        pos = index[:, None] - jnp.arange(L - 1, -1, -1, dtype=jnp.int32)[None, :]  # [B, L], the last is `index`
        window = jnp.take_along_axis(s.tokens, jnp.clip(pos, 0, self.S - 1), axis=1)
        window = jnp.where(jnp.arange(L)[None, :] == L - 1, tok[:, None], window)
        match = jnp.all((seqs[None] == window[:, None]) | (seqs[None] < 0), axis=-1)  # [B, J]
        inside = index[:, None] - lens[None, :] + 1 >= s.prompt_len[:, None]
        return jnp.any(match & inside, axis=1)

    def _decode_and_swap(
        self, params: Any, s: DecodeState, prefill: DecodeState, park: KVCache | None, p: jax.Array, slot: jax.Array,
        version: jax.Array, uid: jax.Array, k: jax.Array, max_steps: jax.Array, more: jax.Array, at: jax.Array,
        feed: jax.Array, feed_len: jax.Array,
    ) -> tuple[DecodeState, jax.Array]:
        """`p` >= 0: insert prefill row p, or, with `at` >= 0 (multi-turn engines), the continuation of park row
        `at` by `feed[:feed_len]` (`_continuation`); `more`: the host has rows waiting after it (no decode while
        one could fill a free slot). Returns the state and the row taken out, packed (`state.pack_row`)."""
        want_insert = p >= 0
        row_key = jax.random.fold_in(jax.random.fold_in(s.key, uid), k)
        steps0 = s.steps
        # A free row is filled before the loop, which then decodes with it: one call per row, where filling after
        # the loop took a second, zero-step call (multi-turn engines free a row at every turn's end).
        fill = want_insert & jnp.any(~s.active)
        free_row = jnp.argmax(~s.active).astype(jnp.int32)
        with jax.named_scope("fill_free_row"):
            s = jax.lax.cond(fill & (at < 0), lambda s: self._insert(s, prefill, p, free_row, slot, row_key),
                             lambda s: s, s)
            if self.Q:
                # Its own conditional, after the prefill's. Nested in it, XLA copied the whole decode cache on every
                # call for the Llama 3.1-8B preset (22 GB, 50 ms a call against 16); choosing the source row first
                # and inserting it once copied that row twice (1.2 GB more a call for Qwen3-8B).
                s = jax.lax.cond(fill & (at >= 0), lambda s: self._insert(
                    s, self._continuation(park, at, feed, feed_len), 0, free_row, slot, row_key), lambda s: s, s)

        cond = lambda s: (jnp.any(s.active) & ~jnp.any(s.active & s.stop) & ~(more & jnp.any(~s.active))  # noqa: E731
                          & (s.steps - steps0 < max_steps))
        with jax.named_scope("single_decode_loop"):
            s = jax.lax.while_loop(cond, lambda s: self._decode_step(params, s, version), s)
        done = s.active & s.stop
        # One stopped row is extracted and, if a sample is queued and was not filled in above, replaced.
        any_done = jnp.any(done)
        substitute = want_insert & ~fill & any_done & (at < 0)  # a continuation only fills a free slot
        inserted = fill | substitute  # False when the chunk ran out with every row still live
        row = jnp.where(any_done, jnp.argmax(done), free_row).astype(jnp.int32)
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
            end_of_think=take(s.end_of_think), inserted=inserted, row=row,
        )
        with jax.named_scope("sub_next_batch"):
            s = jax.lax.cond(
                substitute,
                lambda s: self._insert(s, prefill, p, row, slot, row_key),
                lambda s: jax.lax.cond(any_done, lambda s: deactivate_row(s, row), lambda s: s, s),
                s,
            )
        return s, pack_row(finished)

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
        rows = prefill.next_token.shape[0]  # a prefill or extend batch, or one continuation row
        prefill_specs = jax.tree.map(lambda ns: ns.spec, self.state_shardings(rows, split_rows=False))

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

    def _new_state(self) -> DecodeState:
        key = jax.random.PRNGKey(self._seed)
        sh = self.state_shardings(self.B)
        if self.mesh is None:
            return jax.jit(lambda k: self._empty(self.B, k))(key)
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda k: self._empty(self.B, k), out_shardings=sh)(key)
