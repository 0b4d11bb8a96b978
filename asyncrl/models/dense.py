"""Output-major weights: how the inference engine on the CPU stores a matmul weight, and the matmul that reads it.

A decode step multiplies a few rows (B of them, 1 to 64) by every weight. XLA:CPU's kernels are markedly faster
for that product in the form [N, K] x [K, B] -> [N, B] than in the form [B, K] x [K, N] -> [B, N]. Measured on
the 2-core benchmark machine, fp32, B=16 (`benchmarks/README.md`, "decode"): SmolLM2-135M's 30 layers of
projections took 30-31 ms against 37-40 ms, and its [576 -> 49152] LM head 7.0 ms against 10.4 ms.

So the engine on the CPU transposes each weight once per weight sync (`cpu_decode_layer`, from
`Engine._prepare`) into an `OutputMajor` leaf: the output dims first, the contracted dims last. `dense` computes
W^T x^T and transposes the small [N, B] result back to [B, N]. XLA's simplifier would otherwise fold that
transpose into the dot and pick the slow kernel again; an optimization barrier between them keeps the fast one.

Training and the TPU programs never see an `OutputMajor`: their compiler picks layouts itself, and the barrier
would only cost them fusions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.models.config import ModelConfig
from asyncrl.models.lora import N_IN, LoraWeight, delta as lora_delta
from asyncrl.models.params import unstack_layers

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class OutputMajor:
    """A weight stored [*out, *in]; `x [..., *in] -> [..., *out]` contracts its last `n_in` dims."""

    t: Any
    n_in: int = field(metadata=dict(static=True))


def output_major(w: jax.Array, n_in: int) -> OutputMajor:
    """`w` in the usual [*in, *out] layout (the model's einsums) -> an OutputMajor leaf (a transposed copy)."""
    return OutputMajor(jnp.transpose(w, (*range(n_in, w.ndim), *range(n_in))), n_in)


def dense(x: jax.Array, w: OutputMajor, **kw: Any) -> jax.Array:
    """[..., *in] x OutputMajor -> [..., *out], computed as [*out, *in] x [..., *in]^T -> [*out, ...]."""
    n_out, n_lead = w.t.ndim - w.n_in, x.ndim - w.n_in
    o, i, b = _LETTERS[:n_out], _LETTERS[n_out:n_out + w.n_in], _LETTERS[n_out + w.n_in:n_out + w.n_in + n_lead]
    eq = f"{o}{i},{b}{i}->{o}{b}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.explicit_axes:
        # The output keeps the weight's split of its out dims and the input's split of its rows; a split
        # contracted dim (a tensor-parallel wo / w_down) is summed over, as the model's own einsums do.
        t_spec, x_spec = jax.typeof(w.t).sharding.spec, jax.typeof(x).sharding.spec
        kw["out_sharding"] = P(*t_spec[:n_out], *x_spec[:n_lead])
    y = jax.lax.optimization_barrier(jnp.einsum(eq, w.t, x, **kw))
    return jnp.transpose(y, (*range(n_out, n_out + n_lead), *range(n_out)))


def einsum(eq: str, x: jax.Array, w: Any, **kw: Any) -> jax.Array:
    """`jnp.einsum(eq, x, w)` for a weight in any form (`eq` names the usual [*in, *out] layout): plain,
    output-major, or a LoRA-adapted weight (the base product plus the adapters' `lora.delta`)."""
    if isinstance(w, LoraWeight):
        y = einsum(eq, x, w.w, **kw)
        return y + lora_delta(x, w, y)
    return dense(x, w, **kw) if isinstance(w, OutputMajor) else jnp.einsum(eq, x, w, **kw)


def cpu_decode_layer(layer: Any) -> Any:
    """A per-layer LayerParams with every matrix output-major (norm scales unchanged; a LoRA-adapted weight's
    base is transposed, its small adapters are not). A mixture-of-experts layer's MLP (`moe`, its dense MLP
    fields None) keeps the trainer's layout: its experts are grouped matmuls (`ragged_dot`, which takes the
    weights [E, in, out]) over the tokens routed to them, not a product of every row with every weight."""

    def one(w: Any, n_in: int) -> Any:
        if w is None:
            return None
        if isinstance(w, LoraWeight):
            return dataclasses.replace(w, w=output_major(w.w, n_in))
        return output_major(w, n_in)

    return type(layer)(**{f: one(getattr(layer, f), N_IN[f]) if f in N_IN else getattr(layer, f)
                          for f in layer.__dataclass_fields__})


def cpu_decode_layout(params: Any, cfg: ModelConfig | None = None) -> Any:
    """Params -> per-layer in model order (`params.unstack_layers`; `cfg` places a MoE model's dense-MLP layers)
    with output-major matrices and LM head; the embedding table stays [V, D]: it is already output-major for a
    tied head."""
    params = unstack_layers(params, cfg)
    return type(params)(embed=params.embed, layers=tuple(cpu_decode_layer(l) for l in params.layers),
                        final_norm=params.final_norm,
                        lm_head=None if params.lm_head is None else output_major(params.lm_head, 1))


def is_output_major(params: Any) -> bool:
    """Whether `params` is the engine's CPU decode layout (per-layer, output-major matrices)."""
    if not isinstance(params.layers, tuple):
        return False
    wq = params.layers[0].wq
    return isinstance(wq.w if isinstance(wq, LoraWeight) else wq, OutputMajor)


def project_heads(a: jax.Array, w: Any) -> jax.Array:
    """[B, T, D] x [D, N, Dh] -> [B, T, N, Dh] as one [D, N*Dh] matmul (a cached forward's q/k/v). Given the 4-D
    einsum, TPU relayouts the whole stacked [L, D, N, Dh] weight to head-major on every decode call (3 GB per call
    for an 8B model); the merged 2-D weight is already in the layout its matmul reads."""
    if isinstance(w, LoraWeight):
        y = project_heads(a, w.w)
        return y + lora_delta(a, w, y)
    if isinstance(w, OutputMajor):  # the engine's CPU layout
        return dense(a, w)
    B, T, _ = a.shape
    D, N, Dh = w.shape
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return jnp.einsum("btd,dn->btn", a, w.reshape(D, N * Dh)).reshape(B, T, N, Dh)
    w_spec, a_spec = jax.typeof(w).sharding.spec, jax.typeof(a).sharding.spec
    w2 = w.reshape(D, N * Dh, out_sharding=P(w_spec[0], w_spec[1]))
    y = jnp.einsum("btd,dn->btn", a, w2, out_sharding=P(a_spec[0], a_spec[1], w_spec[1]))
    return y.reshape(B, T, N, Dh, out_sharding=P(a_spec[0], a_spec[1], w_spec[1], None))
