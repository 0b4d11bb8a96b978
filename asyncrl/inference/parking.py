"""The park store of a multi-turn replica (`ParkStore`) and the programs that move rows through it (`ParkPrograms`).

A row that ends its turn leaves its keys and values in a park row while its environment steps, so its decode slot
serves another row meanwhile. It comes back one of two ways:
- fed by decode steps (`_continuation`, a continuation of at most `inference.decode_feed_tokens` tokens): the decode
  call that fills a free slot takes the parked cache as it is, and its steps force the continuation's tokens one a
  step beside the other rows;
- through `extend` (`_extend_fn`, longer continuations): its tokens appended to the parked cache in one batched
  forward, and the row inserted like a prefilled prompt.
Single-turn engines have no park store and compile none of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from asyncrl.inference.layout import Layout
from asyncrl.inference.state import DecodeState
from asyncrl.models import kvcache
from asyncrl.models.kvcache import KVCache


class ParkPrograms:
    """The jitted `park` and `extend` of one multi-turn replica (its `layout`), and the continuation that `decode`
    fills a free slot from (`_continuation`, traced inside `DecodePrograms.decode`)."""

    def __init__(self, layout: Layout):
        self.layout, self.cfg, self.model, self.mesh = layout, layout.cfg, layout.model, layout.mesh
        self.S, self.B, self.P, self.Q, self.F = layout.S, layout.B, layout.P, layout.Q, layout.F
        self.park = jax.jit(self._park_fn, donate_argnums=(1,), out_shardings=layout.park_shardings())
        self.extend = jax.jit(self._extend_fn, out_shardings=layout.state_shardings(self.P, split_rows=False))

    def _park_fn(self, kv: KVCache, park: KVCache, row: jax.Array, at: jax.Array) -> KVCache:
        """Decode row `row`'s keys, values and length (from the decode state's cache `kv`, only read) into park row
        `at`. It takes the cache alone, not the weights or the whole state: each argument leaf costs the dispatch
        time, and this program runs once per turn. Rows split over a data axis: the device holding the row slices
        it out, the others give zeros, and a sum over the data axis hands it to every device (a masked reduction
        over all rows read the whole decode cache: 27 GB and 9.9 ms a call for the Llama 8B preset, 0.4 ms
        ideal)."""
        sel = jnp.arange(kv.length.shape[0]) == row
        length = jnp.sum(jnp.where(sel, kv.length, 0))
        spec = self.layout.data_spec()
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
        cache_specs = jax.tree.map(lambda ns: ns.spec, self.layout.state_shardings(self.B).kv)
        out_specs = jax.tree.map(lambda ns: ns.spec, self.layout.park_shardings())

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
                                  self.layout.state_shardings(rows, split_rows=False).kv)
            _, kv = self.model.apply(params, feed, jnp.where(live, lens, 0), kv, apply_lm_head=False)
            # Laid out as a P-row prefill batch (the rows past `rows` empty), so the one decode program takes it.
            pad = lambda x, axis: jnp.pad(x, [(0, self.P - rows) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
            state = self.layout.empty(self.P, jnp.zeros((2,), jnp.uint32), split_rows=False)
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

    def _continuation(self, park: KVCache, at: jax.Array, feed: jax.Array, n: jax.Array) -> DecodeState:
        """A one-row state that continues park row `at` by `feed[:n]`: the turn's last sampled token, which the
        cache does not hold yet and the first decode step feeds, then the observation, forced token by token by the
        steps after it (`_decode_step`). Its cache is the parked one, unchanged; its turn's first sampled token
        goes at `prompt_len`, the position after the observation."""
        length = jax.lax.dynamic_slice_in_dim(park.length, at, 1)  # [1]: the cache holds [0, length)
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, at, 1, axis=1)  # noqa: E731
        pos = jnp.arange(self.S)[None, :] - length[:, None]  # [1, S]: index into the feed
        obs = (pos >= 1) & (pos < n)
        row = self.layout.empty(1, jnp.zeros((2,), jnp.uint32), split_rows=False)
        row.kv = KVCache(k=jax.tree.map(take, park.k), v=jax.tree.map(take, park.v), length=length)
        row.next_token = feed[:1]
        row.tokens = jnp.where(obs, jnp.take(feed, jnp.clip(pos, 0, self.F - 1)), row.tokens)
        row.prompt_len = length + n
        if self.cfg.max_new_tokens is not None:  # + the forced EOS slot
            row.limit = jnp.minimum(row.prompt_len + self.cfg.max_new_tokens + 1, self.S)
        return row

    def new_store(self) -> KVCache:
        """The park store, zeroed, on its layout."""
        lay = self.layout
        make = lambda: kvcache.zeros(self.model.cfg, self.Q, self.S, lay.kv_dtype, per_layer=lay.cpu)  # noqa: E731
        return lay.jit_on_mesh(make, lay.park_shardings())


class ParkStore:
    """The park store's rows on the host side: its cache on the device (`kv`, made at the first `generate`), the
    free rows, and the calls that move rows in (`park`) and out (`extend`; the decode call that takes a fed
    continuation's cache releases its row through the scheduler)."""

    def __init__(self, programs: ParkPrograms):
        self.programs, self.layout = programs, programs.layout
        self.kv: KVCache | None = None
        self.free: list[int] = list(range(programs.Q))[::-1]

    def take(self) -> int:
        """A free row, or -1 when the store is full."""
        return self.free.pop() if self.free else -1

    def release(self, row: int) -> None:
        if row >= 0:
            self.free.append(row)

    def park(self, decode_kv: KVCache, row: int, at: int) -> None:
        """Decode row `row`'s cache into park row `at`."""
        self.kv = self.layout.run(self.programs.park, np.int32(row), np.int32(at), device=(decode_kv, self.kv))

    def extend(self, params: Any, version: int, parks: Sequence[int], feeds: Sequence[np.ndarray]) -> DecodeState:
        """One `extend` call: park rows `parks` continued by `feeds` (each the turn's last sampled token, then the
        observation). Rows come in rungs of `extend_rows`; the feed but its last token is padded to an
        `extend_buckets` width, and the last token is passed apart (it is fed by the first decode step)."""
        lay = self.layout
        rows = lay.extend_rows(len(parks))
        toks, lens = lay.padded([f[:-1] for f in feeds], rows, lay.extend_min_bucket())
        idx = np.full((rows,), -1, np.int32)
        idx[: len(parks)] = parks
        last = np.zeros((rows,), np.int32)
        last[: len(feeds)] = [f[-1] for f in feeds]
        return lay.run(self.programs.extend, idx, toks, lens, last, np.int32(version), device=(params, self.kv))
