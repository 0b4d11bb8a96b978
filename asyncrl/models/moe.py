"""Mixture-of-experts MLP (Qwen3-MoE): a router, top-k, and the experts as grouped matmuls over sorted tokens.

Shapes: N tokens, D width, E experts (El of them on one expert shard), I expert width, k experts per token,
A = N*k (token, expert) assignments.

Routing follows transformers' `Qwen3MoeSparseMoeBlock`: logits = x @ router in the activation dtype, a softmax
over all E in fp32, top-k, renormalised over the k when `norm_topk_prob`, cast back. Each token's output is the
weighted sum of its k experts' SwiGLU outputs. Dropless: every assignment is computed (no capacity).

Experts run as `jax.lax.ragged_dot` over the assignments sorted by expert (one grouped matmul per projection,
which XLA:CPU runs too); a call of at most `DENSE_MAX_TOKENS` tokens (a decode step) runs every local expert on
every token instead, weighted by the routing.

Expert parallelism is the SkyRL-tx layout: experts split over the "expert" mesh axis, tokens replicated over it;
each shard computes the assignments routed to its own experts (the others sort to the end, past its group sizes,
and count zero) and one psum over the expert (and tensor-parallel) axes combines them.
In the trainer the expert axis splits the tokens too (it is a data axis outside the MoE layers, `train/mesh.py`):
there the dispatch is an all-gather of the expert group's tokens (and their routing) and the combine a
reduce-scatter of the outputs back onto their tokens' devices. No all-to-all: `ragged_all_to_all` does not run on
XLA:CPU, so this is the path the fake-device tests can check. Per layer and device, with n tokens per device and
ep devices in the group, the all-gather and the reduce-scatter each move (ep - 1) * n * D values, where an
all-to-all dispatch and combine would each move about k * (ep - 1) / ep * n * D: fewer bytes whenever ep <= k
(Qwen3-30B-A3B: k = 8), and no token counts to exchange first (benchmarks/README.md, "MoE at target scale").

Router replay: `moe_mlp(..., expert_ids=ids)` routes each token to the given experts instead of its top-k (a
token given -1 takes its own top-k), with the gate weights still the router's own probabilities at those ids (so
the router keeps its gradient), and every call returns the ids it used (`Model.apply_routed`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.models.config import ModelConfig
from asyncrl.models.params import MoeParams, Params, unstack_layers


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig,
          expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [N, D], router [D, E] -> (gate weights [N, k] in x's dtype, expert ids [N, k] int32).

    With `expert_ids` [N, k] (replay) those are the ids, except in rows marked -1 (a token the sampler did not
    route: a prompt or observation token), which take the router's own top-k; the weights are the softmax
    probabilities at the ids either way, so the router keeps its gradient."""
    logits = jnp.einsum("nd,de->ne", x, router)  # [N, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if expert_ids is not None:
        given = expert_ids.astype(jnp.int32)
        ids = jnp.where(given[:, :1] >= 0, given, ids)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


DENSE_MAX_TOKENS = 64
"""Calls of at most this many tokens (a decode step's rows) run every local expert on every token, weighted by the
routing (zero for the experts a token is not routed to), instead of the grouped matmuls. Such a call is bound by
reading the experts' weights, which both ways read once, and the E/k times more FLOPs stay under that read while
N < peak FLOP/s / HBM bandwidth (about 160 on a v5p). On a TPU `ragged_dot` is a Mosaic kernel, which cannot read a
layer's slice of the stacked weights in place: XLA copied every layer's experts out first, reading and writing them
once more per decode step (benchmarks/README.md, "MoE at target scale")."""


def experts(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    """The experts `first .. first+El-1` (w_gate/w_up [El, D, I], w_down [El, I, D]) applied to their share of
    the assignments (ids, weights [N, k]) of x [N, D]; -> [N, D], zero for tokens routed to none of them."""
    N, k = ids.shape
    El = w_gate.shape[0]
    if N <= DENSE_MAX_TOKENS:
        onehot = (ids - first)[:, :, None] == jnp.arange(El)[None, None, :]  # [N, k, El]; others' experts: none
        gw = jnp.einsum("nk,nke->ne", weights, onehot.astype(weights.dtype))  # [N, El] routing weight, 0 if unrouted
        # Batched over the experts, so each weight is read in its stored layout ([El, D, I]: batch, contracted,
        # kept); contracting D out of the middle of [El, D, I] made XLA transpose the whole stack first.
        xb = jnp.broadcast_to(x[None], (El, N, x.shape[-1]))  # [El, N, D]
        with jax.named_scope("experts_dense"):
            gate = jnp.einsum("end,edi->eni", xb, w_gate)  # [El, N, I]
            up = jnp.einsum("end,edi->eni", xb, w_up)
            h = jax.nn.silu(gate) * up * gw.T[:, :, None]
            return jnp.einsum("eni,eid->nd", h, w_down)
    local = ids.reshape(-1) - first  # [A]
    local = jnp.where((local >= 0) & (local < El), local, El)  # El: another shard's expert, sorted last
    order = jnp.argsort(local, stable=True)  # [A]
    token = order // k  # the token of each sorted assignment
    sizes = jnp.bincount(local, length=El + 1)[:El].astype(jnp.int32)  # [El]; the rest lie past their sum
    xs = jnp.take(x, token, axis=0)  # [A, D]
    with jax.named_scope("experts"):
        gate = jax.lax.ragged_dot(xs, w_gate, sizes)  # [A, I]
        up = jax.lax.ragged_dot(xs, w_up, sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)  # [A, D]
    w = jnp.take(weights.reshape(-1), order)
    w = jnp.where(jnp.take(local, order) < El, w, 0)  # other shards' rows: zero whatever ragged_dot left there
    return jnp.zeros_like(x).at[token].add(out * w[:, None])


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def moe_mlp(x: jax.Array, p: MoeParams, cfg: ModelConfig,
            expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] (the normed residual) and one layer's MoeParams -> (MLP output [B, T, D], expert ids
    [B, T, k] int32). `expert_ids` [B, T, k] replays a routing (module docstring)."""
    B, T, D = x.shape
    k = cfg.num_experts_per_tok

    def local(x, router, w_gate, w_up, w_down, ids, first=0, summed=(), gathered=()):
        xf = x.reshape(-1, D)
        weights, ids = route(xf, router, cfg, None if ids is None else ids.reshape(-1, k))
        if gathered:  # dispatch: every token of this expert group, with its routing
            xs, ws, ids_all = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (xf, weights, ids))
            y = experts(xs, ids_all, ws, w_gate, w_up, w_down, first)
        else:
            y = experts(xf, ids, weights, w_gate, w_up, w_down, first)
        if summed:
            y = jax.lax.psum(y, summed)
            ids = jax.lax.pmax(ids, summed)  # equal on every shard: this only types them replicated
        if gathered:  # combine: each token's sum over the group's experts, back on its own device
            y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        return y.reshape(x.shape), ids.reshape(*x.shape[:-1], k)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return local(x, p.router, p.w_gate, p.w_up, p.w_down, expert_ids)
    x_spec = jax.typeof(x).sharding.spec
    w_specs = [jax.typeof(w).sharding.spec for w in (p.router, p.w_gate, p.w_up, p.w_down)]
    router, gate = w_specs[0].partitions, w_specs[1].partitions  # (a spec typed `reduced` refuses [i])
    ep = _axes(gate[0])  # the expert dim's mesh axes
    tp = _axes(gate[2])  # the expert width's (column-parallel gate/up, row-parallel down: partial sums)
    if _axes(router[0]) or _axes(router[1]) or _axes(gate[1]):
        raise ValueError(f"moe_mlp: router {w_specs[0]} and the experts' D dim {w_specs[1]} must be gathered "
                         "(Model._use) before the layer")
    ids_spec = P(*x_spec.partitions[:2], None)
    # Expert axes that also split the tokens (the trainer's: train/mesh.py) gather them first and scatter the
    # outputs back; over the others (an inference replica's) the tokens are already whole on every shard.
    token_axes = {a for e in x_spec.partitions[:2] for a in _axes(e)}
    gathered = tuple(a for a in ep if a in token_axes)

    def shard(x, router, w_gate, w_up, w_down, ids=None):
        first = 0
        for a in ep:  # this shard's first expert: its index along the expert axes (major to minor) * El
            first = first * mesh.shape[a] + jax.lax.axis_index(a)
        summed = (*[a for a in ep if a not in gathered], *tp)
        # Each shard's gradient for the (replicated) tokens and router is its experts' part: typed varying here,
        # and the transpose sums the parts. Left invariant, their gradients came out wrong here (off by ~10%).
        x, router = jax.lax.pcast((x, router), summed, to="varying") if summed else (x, router)
        return local(x, router, w_gate, w_up, w_down, ids, first * w_gate.shape[0], summed, gathered)

    args, specs = (x, p.router, p.w_gate, p.w_up, p.w_down), (x_spec, *w_specs)
    if expert_ids is not None:
        args, specs = (*args, jax.sharding.reshard(expert_ids, ids_spec)), (*specs, ids_spec)
    with jax.named_scope("moe"):
        return jax.shard_map(shard, in_specs=specs, out_specs=(x_spec, ids_spec))(*args)


def route_dtype(cfg: ModelConfig) -> Any:
    """The dtype of a recorded routing (router replay): int8 up to 128 experts (ids 0..127 and -1, "route freely",
    fit), else int16, so a token's record is Lm x k x 1 or 2 bytes (Qwen3-30B-A3B: 48 x 8 x 1 = 384 bytes a token)."""
    return jnp.int8 if cfg.num_experts <= 128 else jnp.int16


def load_sums(x: jax.Array, router: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """One MoE layer's load over the tokens in `mask` [B, T]: [2, E] fp32, row 0 the assignments each expert got
    (ids [B, T, k], the experts used), row 1 the sum of its router probability (softmax over all E in fp32, as
    `route`). The load-balancing loss (`load_balancing_loss`) reads them summed over layers and micro-batches.
    The router matmul is done again here, outside the experts' shard_map: [N, D] x [D, E] is ~1/(3 k I / E) of
    the layer's expert FLOPs (under 1% for Qwen3-30B-A3B)."""
    E = router.shape[-1]
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, router).astype(jnp.float32), axis=-1)  # [B, T, E]
    m = mask.astype(jnp.float32)[..., None]
    counts = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32), axis=2)  # [B, T, E]
    return jnp.stack([jnp.sum(counts * m, axis=(0, 1)), jnp.sum(probs * m, axis=(0, 1))])


def load_balancing_loss(sums: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """sums [Lm, 2, E] (`load_sums` of every MoE layer), tokens: the masked token count -> (loss, load [E]).

    transformers' `load_balancing_loss_func`: every layer's tokens pooled, f_e the fraction of (token, slot) pairs
    per expert summed over the k slots, P_e the mean router probability, loss = E * sum_e f_e P_e (k at a uniform
    router and load, more as either concentrates). `load` is each expert's share of the
    assignments (sums to 1; 1/E when balanced)."""
    E = sums.shape[-1]
    total = jnp.sum(sums, axis=0)  # [2, E]
    n = jnp.maximum(sums.shape[0] * tokens, 1.0)  # layer-tokens pooled
    return E * jnp.sum((total[0] / n) * (total[1] / n)), total[0] / (n * k)


def layer_order(params: Params, cfg: ModelConfig) -> Params:
    """A MoE model with dense-MLP layers -> its layers one by one in model order (a tuple of per-layer
    LayerParams, which the forward runs as a Python loop: `params.unstack_layers`); any other model unchanged."""
    return params if params.dense_layers is None else unstack_layers(params, cfg)
