"""Per-token logprobs of the sampled tokens without materialising the [N, V] logits.

Temperature semantics (everywhere in asyncrl): a token's logprob is `log_softmax(logits / temperature)` at the
sampled token, i.e. under the distribution the sampler actually drew from, so that trainer and sampler logprobs
are comparable in the importance ratio. Temperature 0 means greedy decoding; its logprobs are reported under
temperature 1. Since `logits / t == (h / t) @ W`, callers scale the hidden states with `scale_for_temperature`
and the kernels below take no temperature argument.

`fused_linear_selection(h, W, targets)` returns `log_softmax(h @ W)[i, targets[i]]`. The N tokens are cut into
chunks and a `lax.scan` computes one chunk's [C, V] logits at a time in fp32 (MiniMax-M1 found a bf16 LM head
makes trainer and sampler probabilities drift apart). A custom VJP recomputes each chunk's softmax in the
backward pass instead of saving it, so peak memory is O(C * V) rather than O(N * V) in both directions.

Sharding. When the ambient mesh (`jax.set_mesh` / `jax.sharding.use_mesh`) has any of the data axes
`TOKEN_AXES` (`sharding/axes.py`), every chunk is split over all of them: the chunked hidden states are constrained to
`P(None, DATA, None)`, targets to `P(None, DATA)`, and W is gathered (`P()`). `chunk_size` counts tokens per
device: a chunk holds `chunk_size` rows on every data shard (W is read once per chunk, so chunks are sized per
chip), and W's gradient is summed straight onto W's own sharding (a reduce-scatter under FSDP). Explicit axes are
constrained with `jax.sharding.reshard` (in jax 0.10 `with_sharding_constraint` only asserts under explicit
axes), auto axes with `with_sharding_constraint`. Without such a mesh it runs as plain single-device code.

Chunks are formed from each device's own rows (token i of device d's shard goes into device d's slice of a
chunk), not from consecutive global rows as in the reference implementation: a data-sharded input then needs
no all-to-all to be chunked. Tokens are independent, so the permutation is undone on the way out and is
invisible to callers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from asyncrl.sharding.axes import TOKEN_AXES

# Casting to fp32 is not enough on TPU (and on GPUs with TF32): the default precision of an f32 matmul there is a
# single bf16 (TF32) pass, whose logprob error (~1e-2 at Qwen-sized logits) would swamp the importance ratio.
# HIGH (three bf16 passes, ~2^-16 relative) is within ~1e-4 of fp32 (tests/test_lm_head_precision.py emulates
# both), at half the cost of HIGHEST's six passes. The forward and the backward's recomputation use the same
# precision, so the recomputed softmax still sums to one against the saved log-normaliser.
LM_HEAD_PRECISION = jax.lax.Precision.HIGH
# `model.logits_precision`: 'default' is one bf16 pass with fp32 accumulation (a third of HIGH's MXU work on the
# LM head, the trainer's largest matmul at Qwen vocabularies); see benchmarks/logits_precision.py for the mismatch
# each causes against the sampler. The CPU computes every precision in full fp32.
LOGITS_PRECISIONS = {"high": jax.lax.Precision.HIGH, "default": jax.lax.Precision.DEFAULT}


def scale_for_temperature(h: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """Scale final hidden states so that `scaled_h @ W == logits / temperature`.

    Temperature 0 (greedy) leaves h unchanged: greedy samples are scored under temperature 1. The result keeps
    h's dtype so that a bf16 activation is not silently doubled in size.
    """
    if isinstance(temperature, (int, float)):
        return h if temperature == 0 else (h / temperature).astype(h.dtype)
    temperature = jnp.asarray(temperature, jnp.float32)
    # Divide by 1 rather than select after dividing by 0, which would leave NaNs in the gradient.
    safe = jnp.where(temperature > 0, temperature, 1.0)
    return (h / safe).astype(h.dtype)


@dataclasses.dataclass(frozen=True)
class _DataLayout:
    """Which data axes of the ambient mesh split a chunk, and how to constrain onto them."""

    axes: tuple[str, ...]
    size: int
    explicit: bool

    @property
    def data(self) -> tuple[str, ...] | None:
        return self.axes or None

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        if not self.axes:
            return x
        if self.explicit:
            return jax.sharding.reshard(x, spec)
        return jax.lax.with_sharding_constraint(x, spec)

    def reshape(self, x: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
        if not self.axes:
            return x.reshape(shape)
        if self.explicit:
            # Explicit reshape rules would otherwise pick their own split of the mesh axes over the new dims.
            return jnp.reshape(x, shape, out_sharding=spec)
        return jax.lax.with_sharding_constraint(x.reshape(shape), spec)

    def match(self, x: jax.Array, like: jax.Array) -> jax.Array:
        """Give a cotangent the sharding of its primal (explicit mode checks it; auto mode leaves it to XLA)."""
        if not (self.axes and self.explicit):
            return x
        return jax.sharding.reshard(x, _cotangent_spec(like))


def _cotangent_spec(like: jax.Array) -> P:
    """The layout of `like`'s cotangent: its own, except that a primal `reduced` over some axes (an FSDP weight
    gathered by `Model._use`) takes a cotangent `unreduced` over them, summed by the caller's reduce-scatter."""
    spec = jax.typeof(like).sharding.spec
    return P(*spec.partitions, unreduced=spec.reduced) if spec.reduced else spec


def _current_layout() -> _DataLayout:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _DataLayout((), 1, False)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    # Manual axes (inside shard_map) are already split by the caller; they cannot be constrained again.
    axes = tuple(a for a in TOKEN_AXES if a in types and types[a] != AxisType.Manual)
    if not axes:
        return _DataLayout((), 1, False)
    kinds = {types[a] for a in axes}
    if len(kinds) > 1:
        raise ValueError(f"data axes {axes} mix axis types {sorted(map(str, kinds))}; use all Explicit or all Auto")
    return _DataLayout(axes, math.prod(mesh.shape[a] for a in axes), AxisType.Explicit in kinds)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """How N tokens are padded and cut into `num_chunks` chunks of `chunk` rows (`local` rows per data shard)."""

    n_tokens: int
    n_shards: int
    rows: int  # real rows per data shard (after padding N to a multiple of n_shards)
    num_chunks: int
    local: int  # rows per data shard per chunk

    @property
    def chunk(self) -> int:
        return self.local * self.n_shards

    @property
    def padded_rows(self) -> int:
        return self.num_chunks * self.local


def _geometry(n_tokens: int, chunk_size: int, n_shards: int) -> _Geometry:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    rows = -(-n_tokens // n_shards)
    # Per shard, not over the mesh: each chunk re-reads the whole gathered W (and the backward re-writes its
    # gradient), so a chunk must be as large per chip as memory allows, whatever the number of chips.
    local = max(1, min(chunk_size, rows))
    num_chunks = -(-rows // local)
    # Spread the rows evenly over the chunks so that padding is below one row per chunk and shard.
    local = -(-rows // num_chunks)
    return _Geometry(n_tokens, n_shards, rows, num_chunks, local)


def _to_chunks(x: jax.Array, geo: _Geometry, layout: _DataLayout) -> jax.Array:
    """[N, ...] -> [num_chunks, chunk, ...], each chunk split over the data axes."""
    rest = x.shape[1:]
    tail = (None,) * len(rest)
    n, data = geo.n_shards, layout.data
    if geo.rows * n != geo.n_tokens:
        x = jnp.pad(x, ((0, geo.rows * n - geo.n_tokens),) + ((0, 0),) * len(rest))
    x = layout.constrain(x, P(data, *tail))
    x = layout.reshape(x, (n, geo.rows) + rest, P(data, None, *tail))  # [n, rows, ...]
    if geo.padded_rows != geo.rows:
        x = jnp.pad(x, ((0, 0), (0, geo.padded_rows - geo.rows)) + ((0, 0),) * len(rest))
    x = layout.reshape(x, (n, geo.num_chunks, geo.local) + rest, P(data, None, None, *tail))
    x = jnp.swapaxes(x, 0, 1)  # [num_chunks, n, local, ...]: a shard's rows stay on that shard
    return layout.reshape(x, (geo.num_chunks, geo.chunk) + rest, P(None, data, *tail))


def _from_chunks(y: jax.Array, geo: _Geometry, layout: _DataLayout) -> jax.Array:
    """Inverse of `_to_chunks`: [num_chunks, chunk, ...] -> [N, ...]."""
    rest = y.shape[2:]
    tail = (None,) * len(rest)
    n, data = geo.n_shards, layout.data
    y = layout.reshape(y, (geo.num_chunks, n, geo.local) + rest, P(None, data, None, *tail))
    y = jnp.swapaxes(y, 0, 1)  # [n, num_chunks, local, ...]
    y = layout.reshape(y, (n, geo.padded_rows) + rest, P(data, None, *tail))
    y = y[:, : geo.rows]
    y = layout.reshape(y, (n * geo.rows,) + rest, P(data, *tail))
    if n * geo.rows != geo.n_tokens:
        # An uneven token count cannot stay split over the data axes anyway.
        y = layout.constrain(y, P(*(None,) * y.ndim))[: geo.n_tokens]
    return y


def _chunk_forward(
    h_c: jax.Array, W: jax.Array, t_c: jax.Array, with_entropy: bool, precision: jax.lax.Precision = LM_HEAD_PRECISION
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One chunk: h_c [C, D] f32, W [D, V] f32, t_c [C] -> (logprob [C], logsumexp [C], entropy [C] | None)."""
    logits = jnp.matmul(h_c, W, precision=precision)  # [C, V]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [C]
    is_target = t_c[:, None] == jnp.arange(W.shape[1], dtype=t_c.dtype)[None, :]  # [C, V]
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)  # [C]
    entropy = None
    if with_entropy:
        p = jnp.exp(logits - lse[:, None])  # [C, V]
        entropy = lse - jnp.sum(p * logits, axis=-1)
    return target_logit - lse, lse, entropy


def _prepare(h: jax.Array, W: jax.Array, targets: jax.Array, chunk_size: int):
    if h.ndim != 2 or W.ndim != 2 or targets.ndim != 1:
        raise ValueError(f"expected h [N, D], W [D, V], targets [N]; got {h.shape}, {W.shape}, {targets.shape}")
    if h.shape[1] != W.shape[0] or h.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: h {h.shape}, W {W.shape}, targets {targets.shape}")
    layout = _current_layout()
    geo = _geometry(h.shape[0], chunk_size, layout.size)
    h_c = _to_chunks(h, geo, layout).astype(jnp.float32)  # [num_chunks, C, D]
    t_c = _to_chunks(targets.astype(jnp.int32), geo, layout)  # [num_chunks, C]
    W32 = layout.constrain(W, P()).astype(jnp.float32)  # [D, V]
    return layout, geo, h_c, t_c, W32


def _sum_onto(x: jax.Array, like: jax.Array, layout: _DataLayout) -> jax.Array:
    """[n, ...] split over the data axes -> sum over n, laid out like `like`."""
    if not (layout.axes and layout.explicit):
        return layout.constrain(jnp.sum(x, axis=0), P())
    return jnp.einsum("n...->...", x, out_sharding=_cotangent_spec(like))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(h, W, targets, chunk_size, with_entropy, precision):
    return _fused_fwd(h, W, targets, chunk_size, with_entropy, precision)[0]


def _fused_fwd(h, W, targets, chunk_size, with_entropy, precision):
    with jax.named_scope("fused_logprobs_fwd"):
        layout, geo, h_c, t_c, W32 = _prepare(h, W, targets, chunk_size)

        def body(_, chunk):
            h_k, t_k = chunk
            return None, _chunk_forward(h_k, W32, t_k, with_entropy, precision)

        _, (lp_c, lse_c, ent_c) = jax.lax.scan(body, None, (h_c, t_c))  # each [num_chunks, C]
        logprobs = _from_chunks(lp_c, geo, layout)
        entropy = None if ent_c is None else _from_chunks(ent_c, geo, layout)
    # Residuals are the caller's own arrays plus the per-token normaliser: fp32 chunked copies of h or a
    # gathered W would each cost more memory than the whole backward pass needs at once.
    return (logprobs, entropy), (h, W, targets, lse_c)


def _fused_bwd(chunk_size, with_entropy, precision, residuals, cotangents):
    del with_entropy
    h, W, targets, lse_c = residuals
    dlogprobs, _ = cotangents  # entropy is a metric: its cotangent is dropped (stop-gradient semantics)
    with jax.named_scope("fused_logprobs_bwd"):
        layout, geo, h_c, t_c, W32 = _prepare(h, W, targets, chunk_size)
        dy_c = _to_chunks(dlogprobs.astype(jnp.float32), geo, layout)  # [num_chunks, C]
        n, data = geo.n_shards, layout.data
        D, V = W32.shape

        def body(dW_n, chunk):
            h_k, t_k, lse_k, dy_k = chunk
            logits = jnp.matmul(h_k, W32, precision=precision)  # [C, V]
            p = jnp.exp(logits - lse_k[:, None])  # [C, V]
            is_target = t_k[:, None] == jnp.arange(V, dtype=t_k.dtype)[None, :]
            dz = dy_k[:, None] * (is_target.astype(jnp.float32) - p)  # [C, V]
            dh_k = jnp.matmul(dz, W32.T, precision=precision)  # [C, D]
            # dW is accumulated per data shard ([n, D, V], split over n) and summed once after the scan:
            # contracting over the split chunk dim here would all-reduce a full [D, V] every chunk.
            h_n = layout.reshape(h_k, (n, geo.local, D), P(data, None, None))
            dz_n = layout.reshape(dz, (n, geo.local, V), P(data, None, None))
            dW_n = dW_n + jnp.einsum("nld,nlv->ndv", h_n, dz_n, precision=precision)
            return layout.constrain(dW_n, P(data, None, None)), dh_k

        dW_n0 = layout.constrain(jnp.zeros((n, D, V), jnp.float32), P(data, None, None))
        dW_n, dh_c = jax.lax.scan(body, dW_n0, (h_c, t_c, lse_c, dy_c))
        # Summed straight onto W's own layout: a reduce-scatter, where summing to a replicated [D, V] and slicing
        # it would all-reduce the whole fp32 gradient.
        dW = _sum_onto(dW_n, W, layout)  # [D, V]
        dh = _from_chunks(dh_c, geo, layout)  # [N, D]
    dh = layout.match(dh.astype(h.dtype), h)
    dW = layout.match(dW.astype(W.dtype), W)
    return dh, dW, np.zeros(targets.shape, dtype=jax.dtypes.float0)


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_linear_selection(h: jax.Array, W: jax.Array, targets: jax.Array, chunk_size: int = 1024,
                           precision: jax.lax.Precision = LM_HEAD_PRECISION) -> jax.Array:
    """`log_softmax(h @ W)[i, targets[i]]` for h [N, D], W [D, V], targets [N] int -> [N] float32.

    Differentiable in h and W (gradients come back in their dtypes and shardings). `chunk_size` is the number of
    tokens per scan step on each data shard. Extra memory per device is two or three [chunk_size, V] fp32
    buffers, plus fp32 copies of W and of its gradient when W is not fp32.
    """
    return _fused(h, W, targets, chunk_size, False, precision)[0]


def fused_logprobs_and_entropy(
    h: jax.Array, W: jax.Array, targets: jax.Array, chunk_size: int = 1024,
    precision: jax.lax.Precision = LM_HEAD_PRECISION,
) -> tuple[jax.Array, jax.Array]:
    """Like `fused_linear_selection`, also returning the full-softmax entropy [N] from the same scan.

    The entropy is for metrics: it carries no gradient, as if wrapped in `stop_gradient`.
    """
    logprobs, entropy = _fused(h, W, targets, chunk_size, True, precision)
    return logprobs, entropy
