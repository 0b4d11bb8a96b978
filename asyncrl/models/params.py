"""The param pytree and its single description.

`abstract(cfg)` returns one tree whose leaves are `ParamSpec`s (shape, logical axes, init scale). Shardings
(`param_shardings`), random init (`init_params`) and checkpoint loading (`checkpoint.py`) all derive from that
one tree, so adding a weight means touching one place.

Layers are stacked on a leading `layers` axis and the decoder runs them with `lax.scan`: compile time stays flat
in depth, which matters on a 2-core CPU as much as on a TPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from asyncrl.models.config import ModelConfig
from asyncrl.sharding.rules import ShardingRules, tree_shardings


@dataclass(frozen=True)
class ParamSpec:
    """Static description of one leaf. Not a pytree node: it is the leaf of the abstract tree."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str  # "normal" (scaled by fan-in), "ones"
    fan_in: int = 1


@jax.tree_util.register_dataclass
@dataclass
class MoeParams:
    """A mixture-of-experts MLP (`moe.py`); every leaf has a leading [L] axis when stacked."""

    router: Any  # [L, D, E]
    w_gate: Any  # [L, E, D, I]
    w_up: Any  # [L, E, D, I]
    w_down: Any  # [L, E, I, D]


@jax.tree_util.register_dataclass
@dataclass
class LayerParams:
    """One decoder block's weights; every leaf has a leading [L] axis when stacked."""

    attn_norm: Any  # [L, D]
    wq: Any  # [L, D, H, Dh]
    wk: Any  # [L, D, K, Dh]
    wv: Any  # [L, D, K, Dh]
    wo: Any  # [L, H, Dh, D]
    q_norm: Any  # [L, Dh] (Qwen3) or None
    k_norm: Any  # [L, Dh] (Qwen3) or None
    mlp_norm: Any  # [L, D]
    w_gate: Any  # [L, D, F], or None in a mixture-of-experts layer
    w_up: Any  # [L, D, F]
    w_down: Any  # [L, F, D]
    moe: Any = None  # MoeParams in a mixture-of-experts layer, else None


@jax.tree_util.register_dataclass
@dataclass
class Params:
    """`layers` stacks every layer of a dense model, or the mixture-of-experts layers of a MoE model
    (`cfg.sparse_layers`); a MoE model's dense-MLP layers (`cfg.dense_layers`, often none) stack in `dense_layers`.
    Stacks of one kind keep the layer loop a `lax.scan`; `moe.layer_order` interleaves them when both exist."""

    embed: Any  # [V, D]
    layers: LayerParams
    final_norm: Any  # [D]
    lm_head: Any  # [D, V], or None when tied to `embed`
    dense_layers: Any = None  # LayerParams [L_dense, ...] of a MoE model with dense-MLP layers, else None


def abstract(cfg: ModelConfig) -> Params:
    """The tree of ParamSpecs: the one place that knows every weight's shape and logical axes."""
    L, D, F, H, K, Dh, V = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    )
    qk = cfg.qk_norm

    def layer_specs(L: int, moe: bool) -> LayerParams:
        return LayerParams(
            attn_norm=ParamSpec((L, D), ("layers", None), "ones"),
            wq=ParamSpec((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), "normal", fan_in=D),
            wk=ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal", fan_in=D),
            wv=ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal", fan_in=D),
            wo=ParamSpec((L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), "normal", fan_in=H * Dh),
            q_norm=ParamSpec((L, Dh), ("layers", None), "ones") if qk else None,
            k_norm=ParamSpec((L, Dh), ("layers", None), "ones") if qk else None,
            mlp_norm=ParamSpec((L, D), ("layers", None), "ones"),
            w_gate=None if moe else ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal", fan_in=D),
            w_up=None if moe else ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal", fan_in=D),
            w_down=None if moe else ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal", fan_in=F),
            moe=moe_specs(L) if moe else None,
        )

    def moe_specs(L: int) -> MoeParams:
        # Experts split over the "expert" mesh axis; the router's E columns are never split: every shard
        # scores every expert. Each expert's width I shares "mlp" with the dense MLP (tensor parallelism).
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        return MoeParams(
            router=ParamSpec((L, D, E), ("layers", "embed", None), "normal", fan_in=D),
            w_gate=ParamSpec((L, E, D, I), ("layers", "expert", "embed", "mlp"), "normal", fan_in=D),
            w_up=ParamSpec((L, E, D, I), ("layers", "expert", "embed", "mlp"), "normal", fan_in=D),
            w_down=ParamSpec((L, E, I, D), ("layers", "expert", "mlp", "embed"), "normal", fan_in=I),
        )

    n_dense = len(cfg.dense_layers)
    return Params(
        embed=ParamSpec((V, D), ("vocab", "embed"), "normal", fan_in=D),
        layers=layer_specs(len(cfg.sparse_layers), True) if cfg.is_moe else layer_specs(L, False),
        final_norm=ParamSpec((D,), (None,), "ones"),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((D, V), ("embed", "vocab"), "normal", fan_in=D),
        dense_layers=layer_specs(n_dense, False) if cfg.is_moe and n_dense else None,
    )


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """ShapeDtypeStruct tree (what jit lowering and Orbax restore want)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), abstract(cfg), is_leaf=_is_spec)


def logical_axes(cfg: ModelConfig) -> Params:
    return jax.tree.map(lambda s: s.axes, abstract(cfg), is_leaf=_is_spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules, dtype: Any = jnp.float32) -> Params:
    return tree_shardings(rules, mesh, shapes(cfg, dtype), logical_axes(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, shardings: Params | None = None) -> Params:
    """Random init (scaled normal, unit norms). With `shardings`, each leaf is created directly in place."""
    specs = abstract(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = list(jax.random.split(key, len(leaves)))
    shard_leaves = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)

    def make(spec: ParamSpec, k: jax.Array, sharding: Any) -> jax.Array:
        def f(k):
            if spec.init == "ones":
                return jnp.ones(spec.shape, dtype)
            return (jax.random.normal(k, spec.shape, jnp.float32) / np.sqrt(spec.fan_in)).astype(dtype)

        return jax.jit(f, out_shardings=sharding)(k) if sharding is not None else f(k)

    return jax.tree.unflatten(treedef, [make(s, k, sh) for s, k, sh in zip(leaves, keys, shard_leaves)])


def cast(params: Params, dtype: Any) -> Params:
    return jax.tree.map(lambda x: x.astype(dtype), params)


def count(params: Params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def replace(params: Params, **kw: Any) -> Params:
    return dataclasses.replace(params, **kw)


def unstack_layers(params: Params, cfg: ModelConfig | None = None) -> Params:
    """`params.layers` as a tuple of per-layer LayerParams (no leading [L] axis), in model order: the forward then
    loops over layers in Python instead of scanning. XLA:CPU copies a layer's weights out of the stacked arrays on
    every scan step before its matmuls read them (a second pass over all the weights per decode step); separate
    arrays are read in place. Inference on the CPU only: training and TPU programs keep the stacked tree.

    A MoE model's dense-MLP layers (`dense_layers`) interleave with its sparse ones at `cfg`'s layer indices; the
    result has `dense_layers` None, like a dense model's (`moe.layer_order` uses the same order)."""
    if isinstance(params.layers, tuple):
        if params.dense_layers is not None:
            raise ValueError("unstack_layers: per-layer `layers` beside stacked `dense_layers` have no model order")
        return params

    def layer(x: Any, i: int) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x[i]
        sh = x.sharding  # abstract (ahead-of-time) trees: the same layout less the layer axis
        if isinstance(sh, jax.sharding.NamedSharding):
            sh = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sh)

    def split(stack: Any) -> list[Any]:
        n = jax.tree.leaves(stack)[0].shape[0]
        return [jax.tree.map(lambda x, i=i: layer(x, i), stack) for i in range(n)]

    layers = split(params.layers)
    if params.dense_layers is not None:
        if cfg is None:
            raise ValueError("unstack_layers: a MoE model with dense-MLP layers needs its ModelConfig (cfg) to "
                             "know the layer order")
        by_index = dict(zip(cfg.sparse_layers, layers)) | dict(zip(cfg.dense_layers, split(params.dense_layers)))
        layers = [by_index[i] for i in range(cfg.num_layers)]
    return replace(params, layers=tuple(layers), dense_layers=None)
