"""One replica's device programs: bucketed prefill and the decode loop with row substitution, their state
layouts, and their abstract (ahead-of-time) lowering. `engine.Engine` drives them from the host.

- `prefill`, memoized per power-of-two prompt bucket (at most log2(max_seq_len) programs);
- `decode_and_swap`, compiled once: puts the next queued (prompt, sample) row into a free slot, runs decode steps
  in a `lax.while_loop` until some live row stops (or `inference.decode_chunk_steps` pass), takes that row out,
  and puts the queued row in its place if no slot was free. The state is donated.

Multi-turn engines (`inference.max_turns` > 1) add two programs, and a park store: a donated KV cache of
`inference.parked_rows` rows where a row that ends its turn leaves its keys and values while its environment
steps, so its decode slot serves another row meanwhile.
- `park`: copies the cache of the row `decode_and_swap` just took out into a free park row. A multi-turn engine
  runs `decode_and_swap` without a substitution when its batch is full (the row comes out and its slot stays free),
  parks the row, and fills the slot at the start of its next call. Parking inside `decode_and_swap` made XLA copy
  the whole decode cache on every call (measured: 36-45 ms a call on an 8 layer model, 0.4 ms for this program);
- `extend`, memoized per power-of-two width (from 4) and rung of rows (`extend_rows`): takes parked rows, appends
  each one's continuation (its last sampled token and the observation) to its cache at its own offset, attending
  over the cached history, and returns a prefill-like batch whose rows go back into the decode batch like fresh
  prompts. No earlier token is recomputed. Single-turn engines compile exactly the two programs above.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.forcing import force_end_of_think, force_eos
from asyncrl.inference.lowering import AbstractPrograms
from asyncrl.inference.sampling import sample
from asyncrl.inference.state import DecodeState, FinishedRow, deactivate_row, insert_row, pack_row
from asyncrl.models import kvcache
from asyncrl.models.kvcache import KVCache
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.models.transformer import Model


class DecodePrograms(AbstractPrograms):
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

    def park_shardings(self) -> KVCache | None:
        """Layouts of the park store: its rows replicated over the data axis, like a prefill batch's, so any device
        can take a parked row into its part of the decode batch."""
        return None if self.mesh is None else self.state_shardings(self.Q, split_rows=False).kv

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
        self, params: Any, s: DecodeState, prefill: DecodeState, p: jax.Array, slot: jax.Array, version: jax.Array,
        uid: jax.Array, k: jax.Array, max_steps: jax.Array, more: jax.Array,
    ) -> tuple[DecodeState, jax.Array]:
        """`p` >= 0: insert prefill row p; `more`: the host has rows waiting after it (no decode while one could fill
        a free slot). Returns the state and the row taken out, packed (`state.pack_row`)."""
        want_insert = p >= 0
        row_key = jax.random.fold_in(jax.random.fold_in(s.key, uid), k)
        steps0 = s.steps
        # A free row is filled before the loop, which then decodes with it: one call per row, where filling after
        # the loop took a second, zero-step call (multi-turn engines free a row at every turn's end).
        fill = want_insert & jnp.any(~s.active)
        free_row = jnp.argmax(~s.active).astype(jnp.int32)
        with jax.named_scope("fill_free_row"):
            s = jax.lax.cond(fill, lambda s: self._insert(s, prefill, p, free_row, slot, row_key), lambda s: s, s)

        cond = lambda s: (jnp.any(s.active) & ~jnp.any(s.active & s.stop) & ~(more & jnp.any(~s.active))  # noqa: E731
                          & (s.steps - steps0 < max_steps))
        with jax.named_scope("single_decode_loop"):
            s = jax.lax.while_loop(cond, lambda s: self._decode_step(params, s, version), s)
        done = s.active & s.stop
        # One stopped row is extracted and, if a sample is queued and was not filled in above, replaced.
        any_done = jnp.any(done)
        substitute = want_insert & ~fill & any_done
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

    def _park_fn(self, kv: KVCache, park: KVCache, row: jax.Array, at: jax.Array) -> KVCache:
        """Decode row `row`'s keys, values and length (from the decode state's cache `kv`, only read) into park row
        `at`. It takes the cache alone, not the weights or the whole state: each argument leaf costs the dispatch
        time, and this program runs once per turn. Rows split over a data axis: the device holding the row slices
        it out, the others give zeros, and a sum over the data axis hands it to every device (a masked reduction
        over all rows read the whole decode cache: 27 GB and 9.9 ms a call for the Llama 8B preset, 0.4 ms
        ideal)."""
        sel = jnp.arange(kv.length.shape[0]) == row
        length = jnp.sum(jnp.where(sel, kv.length, 0))
        spec = self._data_spec()
        if self.mesh is None or spec is None:
            k, v = kv.k, kv.v
            take = lambda src: jax.lax.dynamic_slice_in_dim(src, row, 1, axis=1)  # noqa: E731  [L, 1, K, S, Dh]
            rows_k, rows_v = jax.tree.map(take, k), jax.tree.map(take, v)
        else:
            rows_k, rows_v = self._row_from_split(kv.k, kv.v, row, spec)

        def put(dst: jax.Array, r: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_slice_in_dim(dst, r.astype(dst.dtype), at, axis=1)

        return KVCache(k=jax.tree.map(put, park.k, rows_k), v=jax.tree.map(put, park.v, rows_v),
                       length=park.length.at[at].set(length))

    def _row_from_split(self, k: Any, v: Any, row: jax.Array, spec: Any) -> tuple[Any, Any]:
        axes = (spec,) if isinstance(spec, str) else tuple(spec)
        cache_specs = jax.tree.map(lambda ns: ns.spec, self.state_shardings(self.B).kv)
        out_specs = jax.tree.map(lambda ns: ns.spec, self.park_shardings())

        def local(k_local, v_local, row):
            b_local = jax.tree.leaves(k_local)[0].shape[1]
            start = jax.lax.axis_index(axes) * b_local
            here = (row >= start) & (row < start + b_local)
            i = jnp.clip(row - start, 0, b_local - 1)
            one = lambda x: jax.lax.psum(  # noqa: E731
                jnp.where(here, jax.lax.dynamic_slice_in_dim(x, i, 1, axis=1), jnp.zeros_like(x[:, :1])), axes)
            return jax.tree.map(one, k_local), jax.tree.map(one, v_local)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(cache_specs.k, cache_specs.v, P()),
                             out_specs=(out_specs.k, out_specs.v))(k, v, row)

    def _extend_fn(self, params: Any, park: KVCache, idx: jax.Array, feed: jax.Array, lens: jax.Array,
                   last: jax.Array, version: jax.Array) -> DecodeState:
        """Continuations [rows]: park rows `idx` (-1: an unused row), each with `feed` [rows, W] (right-padded,
        `lens` valid, at least 1): the last token its turn sampled, which the cache does not hold yet, then its
        observation but for the observation's last token, `last`, which becomes next_token (the first decode step
        feeds it). The feed is appended to the row's cache at its own offset, attending over the cached history
        (the model's cached path, as a decode step, for many tokens at once); no earlier token is recomputed. The
        result is laid out like a prefill batch, and its rows are inserted the same way. `last` travels apart
        from the feed so that the bucket pads only what is computed (a 4-token observation: width 4, not 8)."""
        with jax.named_scope("extend"):
            rows, _ = feed.shape  # a rung of `extend_rows` <= P: a lone continuation does not pay for P rows
            live = idx >= 0
            at = jnp.maximum(idx, 0)
            # One dynamic slice per row, not a gather: the TPU compiler's gather over the park store read all of it
            # (measured: 100 GB a call for the 8B preset's 27 GB store).
            gather = lambda x: jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, at[i], 1, axis=1)  # noqa: E731
                                                for i in range(rows)], axis=1)  # [L, rows, K, S, Dh]
            kv = KVCache(k=jax.tree.map(gather, park.k), v=jax.tree.map(gather, park.v),
                         length=jnp.where(live, jnp.take(park.length, at), 0))
            if self.mesh is not None:
                kv = jax.tree.map(lambda x, ns: jax.sharding.reshard(x, ns.spec), kv,
                                  self.state_shardings(rows, split_rows=False).kv)
            _, kv = self.model.apply(params, feed, jnp.where(live, lens, 0), kv, apply_lm_head=False)
            # Laid out as a P-row prefill batch (the rows past `rows` empty), so the one decode program takes it.
            pad = lambda x, axis: jnp.pad(x, [(0, self.P - rows) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
            state = self._empty(self.P, jnp.zeros((2,), jnp.uint32), split_rows=False)
            state.kv = KVCache(k=jax.tree.map(lambda x: pad(x, 1), kv.k), v=jax.tree.map(lambda x: pad(x, 1), kv.v),
                               length=pad(kv.length, 0))
            state.next_token = pad(last, 0)
            start = state.kv.length + 1  # the first token this turn samples is written here
            state.prompt_len = start
            state.versions = jnp.where(jnp.arange(self.S)[None, :] < start[:, None], version.astype(jnp.int32),
                                       state.versions)
            if self.cfg.max_new_tokens is not None:
                state.limit = jnp.minimum(start + self.cfg.max_new_tokens + 1, self.S)  # + the forced EOS slot
            return state

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

    def _new_park(self) -> KVCache:
        """The park store, zeroed, on its layout."""
        make = lambda: kvcache.zeros(self.model.cfg, self.Q, self.S, self.kv_dtype, per_layer=self.cpu)  # noqa: E731
        if self.mesh is None:
            return jax.jit(make)()
        with jax.set_mesh(self.mesh):
            return jax.jit(make, out_shardings=self.park_shardings())()

    def _new_state(self) -> DecodeState:
        key = jax.random.PRNGKey(self._seed)
        sh = self.state_shardings(self.B)
        if self.mesh is None:
            return jax.jit(lambda k: self._empty(self.B, k))(key)
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda k: self._empty(self.B, k), out_shardings=sh)(key)
