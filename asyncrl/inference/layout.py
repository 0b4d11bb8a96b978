"""One replica's shapes and layouts: the sizes of its decode batch, prefill batch and park store, the shardings its
compiled programs pin, the empty decode state they start from, and the CPU weights' layout. The device programs
(`programs.py`, `parking.py`), their abstract lowering (`lowering.py`) and the host side all read them from here."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.state import DecodeState
from asyncrl.models import dense, kvcache, moe
from asyncrl.models.config import ModelConfig
from asyncrl.models.kvcache import KVCache
from asyncrl.models.tokenizer import bucket_length
from asyncrl.models.transformer import Model


@functools.partial(jax.jit, static_argnums=1)
def cpu_decode_layout(params: Any, cfg: ModelConfig) -> Any:
    """Half-precision leaves as f32, the stacked layers split per layer in model order (`cfg`: a MoE model's
    dense-MLP layers among its sparse ones), the matrices output-major (`Weights._prepare`, `abstract_params`).
    One jitted function at module level, so each weight sync reuses its compiled program (a fresh jit per call
    would recompile on every sync: a compile per step on every replica)."""
    return dense.cpu_decode_layout(jax.tree.map(
        lambda x: x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x, params), cfg)


class Layout:
    """A replica over `mesh` (None = default device): sizes, shardings and the empty state. `model` is the one the
    programs run: with the flash-attention prefill where `inference.prefill_attention` asks for it."""

    EXTEND_MIN_BUCKET = 4
    """Narrowest extend width: a continuation is its last sampled token and an observation, often a few tokens,
    and an extend costs a weight read plus its computed tokens, padding included (`benchmarks/extend_cost.py`, 8
    layers x 512 on a CPU: 8.1 ms + 0.31 ms a token), so every padded column costs what a real one does."""

    def __init__(self, model: Model, cfg: InferenceConfig, mesh: Mesh | None, pad_id: int,
                 record_routes: bool = False):
        """`record_routes` (train.moe.router_replay, a MoE model): the decode state records each fed model token's
        experts (`DecodeState.routes`, Lm*k ids a position)."""
        self.cfg, self.mesh, self.pad_id = cfg, mesh, pad_id
        mc = model.cfg
        self.route_width = len(mc.sparse_layers) * mc.num_experts_per_tok if record_routes and mc.is_moe else 0
        self.route_dtype = moe.route_dtype(mc) if self.route_width else None
        self.routes = ((len(mc.sparse_layers), mc.num_experts_per_tok), self.route_dtype) if self.route_width else None
        """What a finished row's routes unpack to on the host (`state.unpack_row`), or None."""
        self.S = cfg.max_seq_len
        self.B = cfg.max_decode_batch_size
        self.P = cfg.max_prefill_prompts
        self.Q = cfg.parked_rows
        self.F = max(cfg.decode_feed_tokens, 1)  # the feed vector a decode call takes (its width is fixed)
        self.kv_dtype = jnp.dtype(cfg.kv_cache_dtype)
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        self.cpu = all(d.platform == "cpu" for d in devices)
        """On the CPU a replica decodes with per-layer weights and a per-layer KV cache (tuples of arrays, one per
        layer, looped over in Python): XLA:CPU copies a layer's slice out of stacked arrays before every matmul
        that reads it. Other backends keep the stacked trees and the layer scan (TPU reads the slice in place)."""
        flash = cfg.prefill_attention == "flash" or (cfg.prefill_attention == "auto" and devices[0].platform == "tpu")
        self.model = model.with_flash(flash)  # the prefill's (cached attention never uses the kernel)

    # ---- shardings ------------------------------------------------------------------------------------------

    def data_spec(self) -> Any:
        """The mesh axes the decode batch's rows split over (None: not split)."""
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
        m, b = self.mesh, (self.data_spec() if split_rows else None)
        kv = self.model.kv_cache_sharding(m, rows, self.S, self.kv_dtype, per_layer=self.cpu)
        if not split_rows:
            kv = jax.tree.map(lambda ns: NamedSharding(m, P(*[None if i == 1 else e for i, e in enumerate(ns.spec)])),
                              kv)
            kv.length = NamedSharding(m, P(None))
        ns = lambda *spec: NamedSharding(m, P(*spec))  # noqa: E731
        return DecodeState(
            next_token=ns(b), kv=kv, key=ns(), row_key=ns(b, None), tokens=ns(b, None), logprobs=ns(b, None),
            forced=ns(b, None), versions=ns(b, None), prompt_len=ns(b), limit=ns(b), slot=ns(b), active=ns(b),
            stop=ns(b), end_of_think=ns(b), steps=ns(), routes=ns(b, None, None) if self.route_width else None,
        )

    def park_shardings(self) -> KVCache | None:
        """Layouts of the park store: its rows replicated over the data axis, like a prefill batch's, so any device
        can take a parked row into its part of the decode batch."""
        return None if self.mesh is None else self.state_shardings(self.Q, split_rows=False).kv

    # ---- the empty state (traced inside the programs) -------------------------------------------------------

    def empty(self, rows: int, key: jax.Array, split_rows: bool = True) -> DecodeState:
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
            routes=jnp.full((rows, self.S, self.route_width), -1, self.route_dtype) if self.route_width else None,
        )
        sh = self.state_shardings(rows, split_rows) if self.mesh is not None else None
        if sh is not None:  # created directly in the target layout (no replicated intermediate)
            state = jax.tree.map(lambda x, s: jax.sharding.reshard(x, s.spec), state, sh)
        return state

    # ---- buckets and rungs ----------------------------------------------------------------------------------

    def prefill_buckets(self) -> list[int]:
        """Every prompt width `prefill` can compile (prompts are 1 .. max_seq_len - 1 tokens)."""
        return sorted({bucket_length(n, self.cfg.min_prefill_bucket, self.S) for n in range(1, self.S)})

    def extend_min_bucket(self) -> int:
        return min(self.EXTEND_MIN_BUCKET, self.cfg.min_prefill_bucket)

    def extend_rows(self, n: int) -> int:
        """Rows of an extend of n continuations: the next rung of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and
        1.5 times them), capped at max_prefill_prompts. At most a third of the rows are padding (powers of two
        alone: up to half, and 5-7 continuations, what an extend usually takes, paid for 8), for at most twice
        the programs."""
        r = 1
        while r < n:
            r = r * 3 // 2 if r >= 2 and r & (r - 1) == 0 else (r * 4 // 3 if r > 2 else r + 1)
        spec = self.data_spec()  # the rows' activations split over the data axes: a multiple of their size
        axes = () if spec is None else ((spec,) if isinstance(spec, str) else tuple(spec))
        d = int(np.prod([self.mesh.shape[a] for a in axes]))
        return min(-(-r // d) * d, self.P)

    def extend_buckets(self) -> list[int]:
        """Every continuation width `extend` can compile."""
        return sorted({bucket_length(n, self.extend_min_bucket(), self.S) for n in range(1, self.S)})

    # ---- host inputs ----------------------------------------------------------------------------------------

    def padded(self, rows: Sequence[Sequence[int]], n: int | None = None,
               min_bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[n (default P), bucket] right-padded ids and [n] lengths; unused rows are a 1-token dummy, never
        inserted."""
        n = self.P if n is None else n
        width = bucket_length(max(len(p) for p in rows), min_bucket or self.cfg.min_prefill_bucket, self.S)
        toks = np.full((n, width), self.pad_id, np.int32)
        lens = np.ones((n,), np.int32)
        for i, p in enumerate(rows):
            toks[i, : len(p)] = p
            lens[i] = len(p)
        return toks, lens

    def run(self, fn: Any, *host: Any, device: tuple = ()) -> Any:
        """`fn(*device, *host)` with the host arrays placed replicated on this replica's mesh. Host values are
        numpy arrays and scalars, passed to the jitted call as they are (or put in one `device_put`): a `jnp.asarray`
        each cost 0.19 ms a decode call for its 7 scalars, on a 2-core CPU, where a zero-step call costs 0.5 ms."""
        if self.mesh is None:
            return fn(*device, *host)
        rep = NamedSharding(self.mesh, P())
        with jax.set_mesh(self.mesh):  # tracing needs the mesh for explicit-sharding rules (thread-local)
            return fn(*device, *jax.device_put(tuple(host), rep))

    def jit_on_mesh(self, make: Any, out_shardings: Any, *args: Any) -> Any:
        """`make(*args)` jitted and run once on this replica's layout (a zeroed state or store)."""
        if self.mesh is None:
            return jax.jit(make)(*args)
        with jax.set_mesh(self.mesh):
            return jax.jit(make, out_shardings=out_shardings)(*args)
