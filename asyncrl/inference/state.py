"""Fixed-shape decode state, and the row operations of continuous batching on it.

The same pytree holds a prefill batch ([P] rows) and the in-flight decode batch ([B] rows). Every field has the
row (batch) axis first except the KV cache, whose leaves are [L, B, K, S, Dh].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.models.kvcache import KVCache


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    next_token: Any  # [B] int32: token fed at the next step (written to the cache at kv.length)
    kv: KVCache  # k, v [L, B, K, S, Dh]; length [B]
    key: Any  # [2] uint32 base PRNG key (from the engine seed)
    row_key: Any  # [B, 2] uint32: per-sample key, fold_in(fold_in(key, request uid), sample index)
    tokens: Any  # [B, S] int32: prompt + generated tokens
    logprobs: Any  # [B, S] f32: sampler logprob of each generated token (0 on prompt and forced tokens)
    forced: Any  # [B, S] bool: token was forced by the engine
    versions: Any  # [B, S] int32: weight version in force when the token was produced
    prompt_len: Any  # [B] int32
    limit: Any  # [B] int32: total length at which the row is stopped with a forced EOS (<= max_seq_len)
    slot: Any  # [B] int32: host-side id of the (prompt, sample) in the row; -1 if none
    active: Any  # [B] bool: row holds a live sample
    stop: Any  # [B] bool: row finished (EOS or length) and awaits extraction
    end_of_think: Any  # [B] bool
    steps: Any  # [] int32: decode steps run so far (metrics)
    # [B, S, Lm*k] int8/int16 (train.moe.router_replay): the experts each fed model token was routed to at each MoE
    # layer, -1 elsewhere (prompt, observation and forced tokens, and the last token, never fed); None: not recorded
    routes: Any = None


@jax.tree_util.register_dataclass
@dataclass
class FinishedRow:
    """One extracted row. `slot` is -1 when the call extracted nothing (it only filled a free row)."""

    tokens: Any  # [S]
    logprobs: Any  # [S]
    forced: Any  # [S]
    versions: Any  # [S]
    prompt_len: Any  # []
    length: Any  # [] total tokens (prompt + completion)
    slot: Any  # []
    hit_length: Any  # [] bool: stopped by the length limit rather than a sampled EOS
    end_of_think: Any  # [] bool: the row closed its thinking (sampled or forced end-of-think token)
    steps: Any  # [] decode steps this call ran
    inserted: Any  # [] bool: the queued sample went into a row (False when the chunk ended with every row live)
    row: Any  # [] the decode row it was taken from (a multi-turn engine parks that row's cache)
    routes: Any = None  # [S, Lm*k] (`DecodeState.routes`), or None


_SCALARS = ("prompt_len", "length", "slot", "hit_length", "end_of_think", "steps", "inserted", "row")


def pack_row(f: FinishedRow) -> jax.Array:
    """The row as one int32 vector [4 S + 8] (logprobs bit-cast), so that the host takes it in one transfer: the
    decode loop hands one over per call, and its twelve leaves fetched one by one cost 0.33 ms a call against 0.04
    ms packed (a 2-core CPU; a multi-turn engine makes about one call per decode step). Recorded routes follow,
    their int8/int16 ids bit-cast four or two to an int32 (S Lm k bytes, not 4 S Lm k)."""
    vec = lambda x: jnp.reshape(x, (-1,)).astype(jnp.int32)  # noqa: E731
    routes = []
    if f.routes is not None:
        r = jnp.reshape(f.routes, (-1,))
        per = 4 // r.dtype.itemsize
        r = jnp.pad(r, (0, -r.shape[0] % per), constant_values=-1)
        routes = [jax.lax.bitcast_convert_type(jnp.reshape(r, (-1, per)), jnp.int32)]
    return jnp.concatenate([vec(f.tokens), jax.lax.bitcast_convert_type(f.logprobs.astype(jnp.float32), jnp.int32),
                            vec(f.forced), vec(f.versions)] + [vec(getattr(f, n)) for n in _SCALARS] + routes)


def unpack_row(a: np.ndarray, S: int, routes: tuple[tuple[int, int], Any] | None = None) -> FinishedRow:
    """`pack_row`'s vector of a row of S positions, on the host, back into a FinishedRow of numpy values; `routes`
    ((Lm, k), dtype): the row carries recorded routes, returned as [S, Lm, k]."""
    part = lambda i: a[i * S:(i + 1) * S]  # noqa: E731
    tail = a[4 * S:4 * S + len(_SCALARS)]
    flags = {"hit_length", "end_of_think", "inserted"}
    scalars = {n: (np.bool_(tail[i]) if n in flags else np.int32(tail[i])) for i, n in enumerate(_SCALARS)}
    ids = None
    if routes is not None:
        (lm, k), dtype = routes
        ids = np.ascontiguousarray(a[4 * S + len(_SCALARS):]).view(np.dtype(dtype))[:S * lm * k].reshape(S, lm, k)
    return FinishedRow(tokens=part(0), logprobs=part(1).view(np.float32), forced=part(2).astype(bool),
                       versions=part(3), routes=ids, **scalars)


def _row_update(dst: jax.Array, src_row: jax.Array, row: jax.Array, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(dst, src_row.astype(dst.dtype), row, axis=axis)


def _row_take(x: jax.Array, row: jax.Array, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, row, 1, axis=axis)


def insert_row(state: DecodeState, prefill: DecodeState, p: jax.Array, row: jax.Array, slot: jax.Array,
               row_key: jax.Array) -> DecodeState:
    """Copy prefill row `p` (its KV cache, prompt, next token) into decode row `row` and mark it live."""

    def mv(dst, src, axis=0):
        return _row_update(dst, _row_take(src, p, axis), row, axis)

    rows_of = lambda dst, src: jax.tree.map(lambda d, s: mv(d, s, 1), dst, src)  # noqa: E731 (stacked or per-layer)
    kv = KVCache(k=rows_of(state.kv.k, prefill.kv.k), v=rows_of(state.kv.v, prefill.kv.v),
                 length=mv(state.kv.length, prefill.kv.length))
    one = lambda v, dtype: jnp.full((1,), v, dtype)  # noqa: E731
    return DecodeState(
        next_token=mv(state.next_token, prefill.next_token),
        kv=kv,
        key=state.key,
        row_key=_row_update(state.row_key, row_key[None].astype(state.row_key.dtype), row, 0),
        tokens=mv(state.tokens, prefill.tokens),
        logprobs=mv(state.logprobs, prefill.logprobs),
        forced=mv(state.forced, prefill.forced),
        versions=mv(state.versions, prefill.versions),
        prompt_len=mv(state.prompt_len, prefill.prompt_len),
        limit=mv(state.limit, prefill.limit),
        slot=_row_update(state.slot, one(slot, jnp.int32), row, 0),
        active=_row_update(state.active, one(True, jnp.bool_), row, 0),
        stop=_row_update(state.stop, one(False, jnp.bool_), row, 0),
        end_of_think=mv(state.end_of_think, prefill.end_of_think),
        steps=state.steps,
        routes=None if state.routes is None else mv(state.routes, prefill.routes),
    )


def deactivate_row(state: DecodeState, row: jax.Array) -> DecodeState:
    """Free a row. Elementwise on a row mask, so it is valid for any layout of the rows."""
    sel = jnp.arange(state.active.shape[0]) == row
    return DecodeState(
        **{**state.__dict__,
           "active": state.active & ~sel,
           "stop": state.stop & ~sel,
           "slot": jnp.where(sel, -1, state.slot)}
    )
