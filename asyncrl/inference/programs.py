"""One replica's decode programs: bucketed prefill and the decode loop with row substitution. `engine.Engine`
drives them from the host (`scheduler.py`); `lowering.py` lowers them from abstract values.

- `prefill`, memoized per power-of-two prompt bucket (at most log2(max_seq_len) programs);
- `decode`, compiled once (`_decode_and_swap`): puts the next queued (prompt, sample) row into a free slot, runs
  decode steps in a `lax.while_loop` until some live row stops (or `inference.decode_chunk_steps` pass), takes that
  row out, and puts the queued row in its place if no slot was free. The state is donated.

Multi-turn engines (`inference.max_turns` > 1) add the park store's programs (`parking.py`: `park` and `extend`). A
short continuation needs no program of its own: `decode` fills the free slot straight from its park row
(`ParkPrograms._continuation`) and its decode steps feed the continuation a token a step (`_decode_step`,
"feeding"), while the other rows decode. Single-turn engines compile exactly the two programs above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.inference.forcing import force_end_of_think, force_eos
from asyncrl.inference.layout import Layout
from asyncrl.inference.parking import ParkPrograms
from asyncrl.inference.sampling import sample
from asyncrl.inference.state import DecodeState, FinishedRow, deactivate_row, insert_row, pack_row
from asyncrl.models.kvcache import KVCache


class DecodePrograms:
    """The jitted `prefill` and `decode` of one replica (its `layout`); `parking`: the park store's programs of a
    multi-turn replica (None: single-turn), whose continuations `decode` can fill a free slot from."""

    def __init__(self, layout: Layout, parking: ParkPrograms | None, *, eos_id: int, seed: int = 0,
                 substitute: str = "auto", stop: Sequence[Sequence[int]] = (), phrase: list[int] | None = None):
        """`stop`: token sequences that end a row's turn like EOS does (a tool call's closing tag); the sequence's
        tokens stay in the completion as sampled. `phrase`: the think phrase forced at the reasoning budget."""
        self.layout, self.parking, self.eos_id, self.phrase = layout, parking, eos_id, phrase
        self.cfg, self.model, self.mesh = layout.cfg, layout.model, layout.mesh
        self.S, self.B, self.P, self.Q, self.F = layout.S, layout.B, layout.P, layout.Q, layout.F
        self.stop = [tuple(int(t) for t in seq) for seq in stop if len(seq)]
        self._seed = seed
        self._substitute = substitute
        # Pinned output shardings keep the donated state's layout fixed across calls (no silent relayouts).
        state_sh = layout.state_shardings(self.B)
        self.decode = jax.jit(
            self._decode_and_swap, donate_argnums=(1,),
            out_shardings=None if state_sh is None else (state_sh, None),
        )
        self.prefill = jax.jit(self._prefill_fn, out_shardings=layout.state_shardings(self.P, split_rows=False))

    def new_state(self) -> DecodeState:
        """The decode state, empty, on its layout."""
        return self.layout.jit_on_mesh(lambda k: self.layout.empty(self.B, k), self.layout.state_shardings(self.B),
                                       jax.random.PRNGKey(self._seed))

    # ---- compiled functions ---------------------------------------------------------------------------------

    def _prefill_fn(self, params: Any, tokens: jax.Array, lens: jax.Array, version: jax.Array) -> DecodeState:
        """tokens [P, W] right-padded prompts. Caches all but the last prompt token, which becomes next_token.
        No LM head: the first sampled token comes from the first decode step. The prompt positions of `versions`
        hold `version`, the weights that computed their cached keys and values: a weight swap before the first
        decode step must not hide that the prompt's cache is older than every sampled token."""
        with jax.named_scope("prefill"):
            rows, width = tokens.shape
            state = self.layout.empty(rows, jnp.zeros((2,), jnp.uint32), split_rows=False)
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
            if s.routes is None:
                logits, kv = self.model.apply(params, s.next_token[:, None], live.astype(jnp.int32), s.kv)
            else:
                logits, kv, ids = self.model.apply_routed(params, s.next_token[:, None], live.astype(jnp.int32),
                                                          s.kv)  # ids [B, 1, Lm, k]
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
        routes = None if s.routes is None else self._record(s, ids, live)
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
            routes=routes,
        )

    def _record(self, s: DecodeState, ids: jax.Array, live: jax.Array) -> jax.Array:
        """`s.routes` with the fed token's experts written at its position (kv.length) where it is a model token:
        at or past the row's prompt_len and not forced. Prompt, observation (a continuation's feed sits below its
        prompt_len) and forced tokens keep -1: the trainer's router chooses there. So does a multi-turn episode's
        turn-ending token, which the next turn feeds below its prompt_len (left unreplayed)."""
        pos = s.kv.length  # [B]
        forced = jnp.take_along_axis(s.forced, jnp.clip(pos, 0, self.S - 1)[:, None], axis=1)[:, 0]
        model_token = live & (pos >= s.prompt_len) & ~forced
        new = jnp.where(model_token[:, None], ids.reshape(ids.shape[0], -1), -1).astype(s.routes.dtype)  # [B, Lm*k]
        # One row's [Lm*k] at one position each: a batched dynamic-update-slice, not a [B, S, Lm*k] select.
        put = lambda r, v, p: jax.lax.dynamic_update_slice_in_dim(r, v[None], p, axis=0)  # noqa: E731
        return jax.vmap(put)(s.routes, new, jnp.clip(pos, 0, self.S - 1))

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
                continuation = lambda s: self._insert(  # noqa: E731
                    s, self.parking._continuation(park, at, feed, feed_len), 0, free_row, slot, row_key)
                s = jax.lax.cond(fill & (at >= 0), continuation, lambda s: s, s)

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
            if x.dtype == jnp.bool_:
                return jnp.any(m & x, axis=0)
            return jnp.sum(jnp.where(m, x, 0), axis=0).astype(x.dtype)

        length = take(s.kv.length) + 1
        finished = FinishedRow(
            tokens=take(s.tokens), logprobs=take(s.logprobs), forced=take(s.forced), versions=take(s.versions),
            prompt_len=take(s.prompt_len), length=length, slot=jnp.where(any_done, take(s.slot), -1),
            hit_length=take(s.forced)[jnp.clip(length - 1, 0, self.S - 1)], steps=s.steps - steps0,
            end_of_think=take(s.end_of_think), inserted=inserted, row=row,
            routes=None if s.routes is None else take(s.routes),
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
        spec = self.layout.data_spec()
        if self.mesh is None or spec is None:
            return insert_row(s, prefill, p, row, slot, row_key)
        if self._substitute == "naive":
            # What XLA does when left alone (the blog's 75 ms case): gather every row of the state, substitute
            # everywhere, scatter back. Kept for the benchmark against the shard_map version.
            full = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), s)
            out = insert_row(full, prefill, p, row, slot, row_key)
            return jax.tree.map(lambda x, ns: jax.sharding.reshard(x, ns.spec), out,
                                self.layout.state_shardings(self.B))
        return self._insert_shard_map(s, prefill, p, row, slot, row_key)

    def _insert_shard_map(self, s, prefill, p, row, slot, row_key):
        """SPMD substitution that only touches the device holding `row` (the blog's fix: XLA's choice
        all-gathers the KV cache, substitutes everywhere and scatters back)."""
        mesh, spec = self.mesh, self.layout.data_spec()
        axes = (spec,) if isinstance(spec, str) else tuple(spec)
        state_specs = jax.tree.map(lambda ns: ns.spec, self.layout.state_shardings(self.B))
        rows = prefill.next_token.shape[0]  # a prefill or extend batch, or one continuation row
        prefill_specs = jax.tree.map(lambda ns: ns.spec, self.layout.state_shardings(rows, split_rows=False))

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
