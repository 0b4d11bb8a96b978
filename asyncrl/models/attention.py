"""Attention: the dense reference (training, prefill) and the blocked attention of cached decoding.

Shapes: B batch, T new tokens, S cache length, H query heads, K kv heads, G = H/K, Dh head dim, L layers.

The KV cache is stored [L, B, K, S, Dh]: the layout the score and value contractions read directly (per KV head,
positions then head dim), so no step transposes it.

`cached_attention` splits a cached call's keys in two: the cache's written prefix, read in blocks of `block`
positions under an online softmax, and the call's own new keys, which are not in the cache yet (the caller writes
them once, after the layer loop). The block loop stops at the longest row's prefix, so a step reads only what is
written (rounded up to a block), never the whole allocation. Its trip count is therefore data-dependent; it runs
under the named scope `worst_case_trips_<n>` with n = blocks in the whole cache, which the AOT cost model
(`asyncrl/aot/hlo_cost.py`) reads as the loop's trip count, so compiled figures stay an upper bound per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

NEG_INF = -1e30
WORST_CASE_SCOPE = "worst_case_trips_{}"


def group_queries(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [B, T, H, Dh] -> [B, T, K, G, Dh], query heads grouped under their KV head of k [B, T|S, K, Dh].

    Under an Explicit mesh the groups are laid out like k's KV heads (split over tp, or whole when there are
    fewer KV heads than tp devices)."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    m = jax.sharding.get_abstract_mesh()
    if m.empty or not m.explicit_axes:
        return q.reshape(B, T, K, H // K, Dh)
    b_spec, _, kv_spec, _ = jax.typeof(k).sharding.spec
    if kv_spec is None:
        q = jax.sharding.reshard(q, P(b_spec, None, None, None))
    return q.reshape(B, T, K, H // K, Dh, out_sharding=P(b_spec, None, kv_spec, None, None))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_len: jax.Array) -> jax.Array:
    """Dense GQA attention. q: [B, T, H, Dh]; k, v: [B, S, K, Dh]; q_pos: [B, T]; kv_len: [B]. -> [B, T, H, Dh].

    Key j of row b is visible to query t iff j <= q_pos[b, t] (causal) and j < kv_len[b] (written)."""
    B, T, H, Dh = q.shape
    S = k.shape[1]
    qg = group_queries(q, k)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / np.sqrt(Dh)
    j = jnp.arange(S)
    visible = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])  # [B, T, S]
    scores = jnp.where(visible[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, H, Dh)


def _fold(state: tuple, scores: jax.Array, visible: jax.Array, v: jax.Array, eq: str) -> tuple:
    """One online-softmax step: fold scores [B, K, G, T, s] (masked by `visible`) and values v into (m, l, acc)."""
    m, l, acc = state
    scores = jnp.where(visible, scores, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    alpha = jnp.exp(m - m_new)
    # Masked keys get exactly zero weight, even while no row has seen a visible key (m_new still NEG_INF).
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    pv = jnp.einsum(eq, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv


def cached_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                     layer: jax.Array, start: jax.Array, seq_lens: jax.Array, block: int) -> jax.Array:
    """Attention of T new tokens per row over row b's cached prefix [0, start[b]) and its own new keys.

    q: [B, T, H, Dh]; k_new, v_new: [B, T, K, Dh] (this call's keys, not yet in the cache); cache_k, cache_v:
    [L, B, K, S, Dh], read at `layer`; start, seq_lens: [B]. New key t' is visible to query t iff t' <= t and
    t' < seq_lens[b]: the same visibility as `attention` over the updated cache. Returns [B, T, H, Dh]."""
    B, T, H, Dh = q.shape
    K, S = cache_k.shape[2], cache_k.shape[3]
    block = min(block, S)
    scale = 1.0 / np.sqrt(Dh)
    qg = group_queries(q, k_new)  # [B, T, K, G, Dh]

    # The new tokens first: every row that has one sees at least itself, which seeds the running max.
    s_self = jnp.einsum("btkgd,bskd->bkgts", qg, k_new, preferred_element_type=jnp.float32) * scale
    t = jnp.arange(T)
    vis_self = (t[None, :] <= t[:, None])[None] & (t[None, None, :] < seq_lens[:, None, None])  # [B, T, T]
    zeros = jnp.zeros(s_self.shape[:-1], jnp.float32)
    init = (zeros + NEG_INF, zeros, jnp.zeros(s_self.shape[:-1] + (Dh,), jnp.float32))
    state = _fold(init, s_self, vis_self[:, None, None], v_new, "bkgts,bskd->bkgtd")

    n_blocks = -(-S // block)
    live_blocks = (jnp.max(start) + block - 1) // block  # the longest row's prefix, in blocks

    def body(i: jax.Array, state: tuple) -> tuple:
        # The last block of a cache that `block` does not divide is read shifted back to end at S; the positions
        # an earlier block already covered are masked.
        s0 = jnp.minimum(i * block, S - block)
        k_blk = jax.lax.dynamic_slice(cache_k, (layer, 0, 0, s0, 0), (1, B, K, block, Dh))[0].astype(q.dtype)
        v_blk = jax.lax.dynamic_slice(cache_v, (layer, 0, 0, s0, 0), (1, B, K, block, Dh))[0].astype(q.dtype)
        scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_blk, preferred_element_type=jnp.float32) * scale
        j = s0 + jnp.arange(block)
        visible = (j >= i * block)[None, :] & (j[None, :] < start[:, None])  # [B, block]
        return _fold(state, scores, visible[:, None, None, None, :], v_blk, "bkgts,bksd->bkgtd")

    if n_blocks == 1:  # a cache within one block: no loop to bound, and no loop-carried cache buffer on the CPU
        m, l, acc = body(jnp.int32(0), state)
    else:
        with jax.named_scope(WORST_CASE_SCOPE.format(n_blocks)):
            m, l, acc = jax.lax.fori_loop(0, live_blocks, body, state)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, K, G, T, Dh]; a row with no visible key gives 0
    out = jnp.einsum("bkgtd->btkgd", out).astype(q.dtype)
    return out.reshape(B, T, H, Dh)
