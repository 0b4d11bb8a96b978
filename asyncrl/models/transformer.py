"""One decoder for Llama 3/3.1, Qwen3 and Qwen3-MoE (its MLP in `moe.py`): functions over the `Params` pytree.

Shapes: B batch, T new tokens, S cache length, D width, H query heads, K kv heads, G = H/K, Dh head dim,
F MLP width, V vocab, L layers.

Sequence semantics (shared by training, prefill and decode):
- `x` is right-padded; `sequence_lens[b]` is the number of valid tokens of row b in *this call*.
- Without a cache, row b's tokens sit at positions 0..sequence_lens[b]-1.
- With a cache, they are written at positions cache.length[b] + t and the cache length grows by
  sequence_lens[b]. Attention reads the cache's written prefix in blocks and the call's own K/V directly
  (`attention.cached_attention`); the layer loop returns only the new K/V, written once after it. A decode step
  is a call with T=1. `prefill` fills empty rows from position 0 and attends only over the prompt bucket.

Context parallelism (Ulysses, `ulysses.py`): a cache-free forward may keep its activations split over T, with
attention run head-split between two all-to-alls. Calls with a KV cache never split the sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from asyncrl.models import dense as dense_lib, embedding, kvcache, moe as moe_lib, params as params_lib, ulysses
from asyncrl.models.attention import cached_attention
from asyncrl.models.attention_impl import self_attention
from asyncrl.models.config import ModelConfig
from asyncrl.models.kvcache import KVCache, write_call, write_new, write_prefix
from asyncrl.models.lora import LoraWeight, delta as lora_delta
from asyncrl.models.norm import rms_norm
from asyncrl.models.params import LayerParams, Params
from asyncrl.models.rope import apply_rope, rope_tables
from asyncrl.ops.logprobs import fused_linear_selection
from asyncrl.sharding.axes import TOKEN_AXES
from asyncrl.sharding.rules import ShardingRules, drop_axes, spec_entry

_LOGPROB_CHUNK = 1024  # tokens per fused LM-head chunk in `get_logprobs`: bounds the [chunk, V] fp32 temporary


def _explicit_mesh():
    """The active mesh if it has Explicit axes (sharding in types), else None."""
    m = jax.sharding.get_abstract_mesh()
    return None if m.empty or not m.explicit_axes else m


@dataclasses.dataclass(frozen=True)
class Model:
    """Stateless model: `cfg` is static, params are always passed in (so they are jit arguments, never constants).

    `rules` optionally names the activation layout (batch axes etc.) used when a mesh is active. `remat`
    recomputes each layer's activations in the backward pass instead of storing them (training only: the cached
    decode path has no backward), trading ~1/3 more FLOPs for activation memory of one layer instead of all."""

    cfg: ModelConfig
    rules: ShardingRules | None = None
    remat: bool = False
    kv_block: int = 512
    """Cache positions per block of cached attention: a step reads the longest live row rounded up to this."""
    remat_policy: str = "full"
    """With `remat`: 'full' keeps only the residual stream; 'dots' also keeps the matmul outputs."""
    flash: bool = False
    """Attention over the call's own tokens (training; a prefill) through the Pallas kernel (models/flash.py)."""
    attention_impl: str = "auto"
    """Other attention over the call's own tokens: 'auto' picks per platform (models/attention_impl.py)."""
    logits_precision: str = "high"
    """The trainer's fused LM head matmuls (`model.logits_precision`, ops/logprobs.py LOGITS_PRECISIONS)."""

    # ---- caches ---------------------------------------------------------------------------------------------

    def init_kv_cache(self, batch: int, length: int, dtype: Any = jnp.float32, sharding: Any = None,
                      per_layer: bool = False) -> KVCache:
        """Zeroed cache (`kvcache.zeros`); `sharding` is a KVCache of shardings, a mesh (rules apply), or None."""
        if isinstance(sharding, jax.sharding.Mesh):
            sharding = self.kv_cache_sharding(sharding, batch, length, dtype, per_layer)
        return kvcache.zeros(self.cfg, batch, length, dtype, sharding, per_layer)

    def kv_cache_sharding(self, mesh: jax.sharding.Mesh, batch: int, length: int, dtype: Any = jnp.float32,
                          per_layer: bool = False) -> KVCache:
        return kvcache.shardings(self.cfg, self.rules or ShardingRules(), mesh, batch, length, per_layer)

    # ---- explicit sharding ----------------------------------------------------------------------------------
    # Under an Explicit mesh every op must have an unambiguous output sharding. Two things need saying:
    # weights stored sharded over a *data* axis (FSDP) are all-gathered right before use, and contractions
    # over a tensor-parallel axis (wo, w_down) name their output layout, which makes XLA insert the psum.

    def _batch_axes(self, mesh) -> tuple[str, ...]:
        return tuple(a for a in (self.rules or ShardingRules()).mesh_axes("batch") if a in mesh.axis_names)

    def seq_axes(self, mesh: Any = None) -> tuple[str, ...]:
        """Mesh axes that split the sequence of a cache-free forward: the rules' "seq" axes of size > 1.

        `mesh` defaults to the ambient Explicit mesh. Empty for inference rules and meshes, and for a size-1
        cp axis, so that such a forward is exactly the batch-only layout."""
        mesh = _explicit_mesh() if mesh is None else mesh
        if mesh is None:
            return ()
        rules = self.rules or ShardingRules()
        return tuple(a for a in rules.mesh_axes("seq") if a in mesh.axis_names and mesh.shape[a] > 1)

    def _act_spec(self, mesh, ndim: int, seq: tuple[str, ...] = ()) -> P:
        """[B, T, ...] activations: B over the batch axes, T over `seq` (empty unless context parallel)."""
        return P(spec_entry(self._batch_axes(mesh)), *([spec_entry(seq)] if ndim > 1 else []), *([None] * (ndim - 2)))

    def _token_spec(self, mesh, ndim: int) -> P:
        """[B*T, ...] flattened positions: merging a B split over the batch axes with a T split over the seq axes
        is a split over both, in that order, so flattening moves no data."""
        return P(spec_entry(self._batch_axes(mesh) + self.seq_axes(mesh)), *([None] * (ndim - 1)))

    def _use(self, w: jax.Array, summed: tuple[str, ...] = ()) -> jax.Array:
        """Compute view of a stored weight: FSDP shards gathered, tensor-parallel shards kept.

        `summed`: the axes its use contracts over (a layer's batch and sequence axes). The gathered copy typed
        `reduced` over them gets an unreduced gradient, and the gather's transpose is then a reduce-scatter over
        fsdp (plus a dp all-reduce of the shard), not a whole all-reduce and a slice. The retyping first reshard
        is what splits those two steps (tests/test_aot.py::test_fsdp_layer_gradients_are_reduce_scattered_on_v5p)."""
        mesh = _explicit_mesh()
        if mesh is None or w is None:
            return w
        spec = jax.typeof(w).sharding.spec
        # Experts stay split over the expert axis, a data axis too (train/mesh.py): only their FSDP shards gather.
        kept = set((self.rules or ShardingRules()).mesh_axes("expert"))
        new = P(*[drop_axes(e, set(self._batch_axes(mesh)) - kept) for e in spec])
        if tuple(new) == tuple(spec):
            return w
        if summed:
            held = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
            w = jax.sharding.reshard(w, P(*spec, reduced=set(summed) - held))
            new = P(*new, reduced=set(summed) - (held & kept))
        return jax.sharding.reshard(w, new)

    def _contract(self, eq: str, x: jax.Array, w: jax.Array, seq: tuple[str, ...] = (), **kw: Any) -> jax.Array:
        if isinstance(w, LoraWeight):
            y = self._contract(eq, x, w.w, seq, **kw)
            return y + lora_delta(x, w, y)
        if isinstance(w, dense_lib.OutputMajor):
            return dense_lib.dense(x, w, **kw)
        mesh = _explicit_mesh()
        if mesh is None:
            return jnp.einsum(eq, x, w, **kw)
        out_ndim = len(eq.split("->")[1])
        return jnp.einsum(eq, x, w, out_sharding=self._act_spec(mesh, out_ndim, seq), **kw)

    # ---- forward --------------------------------------------------------------------------------------------

    def apply(self, params: Params, x: jax.Array, sequence_lens: jax.Array, kv_cache: KVCache | None = None,
              apply_lm_head: bool = True) -> tuple[jax.Array, KVCache | None]:
        """x: [B, T] int, sequence_lens: [B]. Returns (logits [B, T, V] fp32 or hidden [B, T, D], new cache)."""
        return self._forward(params, x, sequence_lens, kv_cache, apply_lm_head, attend_cache=True)[:2]

    def apply_routed(self, params: Params, x: jax.Array, sequence_lens: jax.Array, kv_cache: KVCache | None = None,
                     apply_lm_head: bool = True, expert_ids: jax.Array | None = None, load_mask: jax.Array | None = None
                     ) -> tuple[jax.Array, KVCache | None, Any]:
        """`apply`, and a MoE model's routing: expert ids [B, T, Lm, k] int32 at its Lm MoE layers (None if dense).
        `expert_ids` [B, T, Lm, k] replays a routing (`moe.route`): the given experts, gate weights recomputed.
        `load_mask` [B, T] (the tokens the load-balancing loss counts): the routing is then (ids, `moe.load_sums`
        of every MoE layer [Lm, 2, E])."""
        return self._forward(params, x, sequence_lens, kv_cache, apply_lm_head, True, expert_ids, load_mask)

    def prefill(self, params: Params, x: jax.Array, sequence_lens: jax.Array, kv_cache: KVCache,
                apply_lm_head: bool = False) -> tuple[jax.Array, KVCache]:
        """`apply` from position 0, into a cache whose rows hold nothing yet (their lengths are ignored):
        attention runs over the call's own tokens (the prompt bucket), never over the cache, and their K/V are
        written at positions 0..T-1 with one dynamic-update-slice."""
        return self._forward(params, x, sequence_lens, kv_cache, apply_lm_head, attend_cache=False)[:2]

    def _embed(self, embed: jax.Array, x: jax.Array, mesh: Any, seq: tuple[str, ...]) -> jax.Array:
        """[B, T] ids -> [B, T, D] rows of the table, in the activation layout."""
        if mesh is None:
            return jnp.take(embed, x, axis=0)
        table = self._use(embed, (*self._batch_axes(mesh), *seq))
        return embedding.lookup(table, x, mesh, self._act_spec(mesh, 2, seq), self._act_spec(mesh, 3, seq))

    def _forward(self, params: Params, x: jax.Array, sequence_lens: jax.Array, kv_cache: KVCache | None,
                 apply_lm_head: bool, attend_cache: bool, expert_ids: jax.Array | None = None,
                 load_mask: jax.Array | None = None) -> tuple:
        c = self.cfg
        params = moe_lib.layer_order(params, c)  # a MoE model with dense-MLP layers: one by one, in model order
        B, T = x.shape
        sequence_lens = sequence_lens.astype(jnp.int32)
        mesh = _explicit_mesh()
        seq = () if mesh is None or kv_cache is not None else self.seq_axes(mesh)  # context-parallel axes
        if seq:
            ulysses.check(self.cfg, T, seq, mesh)
        with jax.named_scope("embed"):
            h = self._embed(params.embed, x, mesh, seq)  # [B, T, D]
        start = kv_cache.length if kv_cache is not None and attend_cache else jnp.zeros((B,), jnp.int32)
        q_pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        kv_len = start + sequence_lens
        # Attention keeps the whole q_pos (its queries span the full sequence); the rotary tables only need the
        # positions a device holds.
        cos, sin = rope_tables(c, jax.sharding.reshard(q_pos, self._act_spec(mesh, 2, seq)) if seq else q_pos)
        own_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))  # positions within the call

        def mlp(h: jax.Array, layer: LayerParams, ids: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
            """-> (h, a MoE layer's expert ids [B, T, k] or None); `ids`: a routing to replay."""
            with jax.named_scope("mlp"):
                m = rms_norm(h, layer.mlp_norm, c.rms_norm_eps)
                if layer.moe is not None:  # a mixture-of-experts layer
                    y, used = moe_lib.moe_mlp(m, layer.moe, c, ids)
                    if load_mask is not None:
                        used = (used, moe_lib.load_sums(m, layer.moe.router, used, load_mask))
                    return h + y, used
                gate = dense_lib.einsum("btd,df->btf", m, layer.w_gate)
                up = dense_lib.einsum("btd,df->btf", m, layer.w_up)
                return h + self._contract("btf,fd->btd", jax.nn.silu(gate) * up, layer.w_down, seq), None

        def block(h: jax.Array, layer: LayerParams, index: jax.Array | int | None, ids: jax.Array | None = None):
            summed = (*self._batch_axes(mesh), *seq) if mesh is not None and kv_cache is None else ()
            layer = jax.tree.map(lambda w: self._use(w, summed), layer)
            with jax.named_scope("attn"):
                a = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
                if kv_cache is None:
                    q = dense_lib.einsum("btd,dhk->bthk", a, layer.wq)
                    k = dense_lib.einsum("btd,dhk->bthk", a, layer.wk)
                    v = dense_lib.einsum("btd,dhk->bthk", a, layer.wv)
                else:
                    q, k, v = (dense_lib.project_heads(a, w) for w in (layer.wq, layer.wk, layer.wv))
                if c.qk_norm:
                    q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
                    k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                if kv_cache is None:
                    if seq:
                        with jax.named_scope("ulysses"):
                            q, k, v = ulysses.to_heads(q, k, v, mesh, self._batch_axes(mesh), seq)
                    o = self_attention(q, k, v, q_pos, kv_len, self.flash, self.attention_impl)  # [B, T, H, Dh]
                    if seq:
                        with jax.named_scope("ulysses"):
                            o = jax.sharding.reshard(o, self._act_spec(mesh, 4, seq))
                elif attend_cache and isinstance(kv_cache.k, tuple):
                    # Per-layer cache leaves [1, B, K, S, Dh]: this layer's new K/V are written first and its
                    # attention reads the written leaf (the new positions sit at >= start, which the prefix
                    # read masks; they are read from k, v directly). Read-after-write is a data dependency, so
                    # the write is in place; a write after the read depends on nothing the read makes, and XLA
                    # copies the leaf to keep the read safe.
                    ck, cv = write_new(kv_cache.k[index], kv_cache.v[index], jnp.swapaxes(k, 1, 2)[None],
                                       jnp.swapaxes(v, 1, 2)[None], start)
                    o = cached_attention(q, k, v, ck, cv, 0, start, sequence_lens, self.kv_block)
                    h = h + self._contract("bthk,hkd->btd", o, layer.wo, seq)
                    h, used = mlp(h, layer, ids)
                    return h, (ck, cv), used
                elif attend_cache:
                    o = cached_attention(q, k, v, kv_cache.k, kv_cache.v, index, start, sequence_lens, self.kv_block)
                else:  # a prefill, causal over its own tokens
                    o = self_attention(q, k, v, own_pos, sequence_lens, self.flash, self.attention_impl)
                h = h + self._contract("bthk,hkd->btd", o, layer.wo, seq)
            h, used = mlp(h, layer, ids)
            # This call's K/V as [B, K, T, Dh], the cache layout: written once, after the layer loop.
            return h, (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)), used

        # Routing: each MoE layer's ids, from the Python loops (`routes`, model order) or a scan's ys [Lm, ...].
        stacked_ids = None if expert_ids is None else jnp.moveaxis(expert_ids, 2, 0)
        routes, scan_routes = [], None

        def replay(layer: LayerParams) -> jax.Array | None:
            return None if expert_ids is None or layer.moe is None else stacked_ids[len(routes)]

        def keep(used: jax.Array | None) -> None:
            if used is not None:
                routes.append(used)

        if kv_cache is None:
            def body(h, xs):
                h, _, used = block(h, *xs)
                return h, used

            if self.remat:  # 'full': only the residual stream between layers; 'dots': matmul outputs too
                policy = {"full": jax.checkpoint_policies.nothing_saveable,
                          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[self.remat_policy]
                body = jax.checkpoint(body, policy=policy)
            if isinstance(params.layers, tuple):  # unstacked (params.unstack_layers): a Python loop
                for layer in params.layers:
                    h, used = body(h, (layer, None, replay(layer)))
                    keep(used)
            else:
                h, scan_routes = jax.lax.scan(body, h, (params.layers, None, stacked_ids))
            new_cache = None
        else:
            if isinstance(kv_cache.k, tuple):  # per-layer cache (the engine on the CPU)
                if not isinstance(params.layers, tuple):
                    raise ValueError("a per-layer KV cache needs per-layer weights (params.unstack_layers)")
                new_k, new_v = [], []
                for i, layer in enumerate(params.layers):
                    h, (k_i, v_i), used = block(h, layer, i, replay(layer))
                    keep(used)
                    if not attend_cache:  # a prefill: the leaf is written after (it reads no cache)
                        k_i, v_i = write_prefix(kv_cache.k[i], kv_cache.v[i], k_i[None], v_i[None])
                    new_k.append(k_i)
                    new_v.append(v_i)
                new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), length=kv_len)
            elif isinstance(params.layers, tuple):  # per-layer weights, stacked cache
                outs = [None] * c.num_layers
                for i, layer in enumerate(params.layers):
                    h, outs[i], used = block(h, layer, i, replay(layer))
                    keep(used)
                ks, vs = jnp.stack([k for k, _ in outs]), jnp.stack([v for _, v in outs])
                new_cache = write_call(kv_cache, ks, vs, start, kv_len, attend_cache)
            else:
                # The cache is read inside the loop (a loop-invariant operand: each layer reads its own blocks)
                # but is neither an xs nor a carry, so no step copies a layer of it out and back.
                def step(h, xs):
                    h, kv, used = block(h, *xs)
                    return h, (kv, used)

                h, ((ks, vs), scan_routes) = jax.lax.scan(
                    step, h, (params.layers, jnp.arange(c.num_layers, dtype=jnp.int32), stacked_ids))
                new_cache = write_call(kv_cache, ks, vs, start, kv_len, attend_cache)

        h = rms_norm(h, self._use(params.final_norm), c.rms_norm_eps)
        if load_mask is None:
            ids = jnp.moveaxis(scan_routes, 0, 2) if scan_routes is not None else (
                jnp.stack(routes, axis=2) if routes else None)  # [B, T, Lm, k]
        elif scan_routes is not None or routes:  # (ids [B, T, Lm, k], load sums [Lm, 2, E])
            used, sums = scan_routes if scan_routes is not None else jax.tree.map(lambda *r: jnp.stack(r), *routes)
            ids = (jnp.moveaxis(used, 0, 2), sums)
        else:
            ids = None
        return (self.lm_head(params, h) if apply_lm_head else h), new_cache, ids

    def lm_head_weight(self, params: Params) -> jax.Array:
        """[D, V] LM head (the transposed embedding when tied), gathered `reduced` over the token axes its fused
        logprob kernel sums its gradient over (`ops/logprobs.py`), so that gradient is reduce-scattered."""
        mesh = _explicit_mesh()
        summed = () if mesh is None else tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
        return self._use(params.embed, summed).T if params.lm_head is None else self._use(params.lm_head, summed)

    def lm_head(self, params: Params, h: jax.Array) -> jax.Array:
        """[..., D] -> fp32 logits [..., V]."""
        if dense_lib.is_output_major(params):  # the engine's CPU layout; a tied [V, D] table is output-major
            w = params.lm_head if params.lm_head is not None else dense_lib.OutputMajor(self._use(params.embed), 1)
            return dense_lib.dense(h, w, preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", h, self.lm_head_weight(params), preferred_element_type=jnp.float32)

    def flatten_positions(self, x: jax.Array) -> jax.Array:
        """[B, T, ...] -> [B*T, ...], keeping a cache-free forward's layout (no data movement)."""
        mesh = _explicit_mesh()
        shape = (x.shape[0] * x.shape[1], *x.shape[2:])
        if mesh is None:
            return jnp.reshape(x, shape)
        return jnp.reshape(x, shape, out_sharding=self._token_spec(mesh, len(shape)))

    def next_token_targets(self, tokens: jax.Array) -> jax.Array:
        """[B, T] -> [B, T]: tokens[:, t+1] at position t, and 0 at the last position (which no caller reads).

        Scoring every position keeps T, rather than T-1, as the length of every sharded dim: T-1 would not divide
        over a context-parallel axis. The shift itself runs on the whole, small, int [B, T] array."""
        mesh = _explicit_mesh()
        if mesh is None:
            return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        whole = jax.sharding.reshard(tokens, self._act_spec(mesh, 2))
        shifted = jnp.pad(whole[:, 1:], ((0, 0), (0, 1)))
        return jax.sharding.reshard(shifted, self._act_spec(mesh, 2, self.seq_axes(mesh)))

    def drop_last_position(self, y: jax.Array, batch: int) -> jax.Array:
        """[B*T] per-position values -> [B, T-1] in the batch-only layout (the last position predicts nothing).

        Explicit sharding refuses to slice a dim split over the sequence axes to an uneven length, so the small
        [B, T] result is gathered over them first."""
        mesh = _explicit_mesh()
        shape = (batch, y.shape[0] // batch)
        if mesh is None:
            return jnp.reshape(y, shape)[:, :-1]
        y = jnp.reshape(y, shape, out_sharding=self._act_spec(mesh, 2, self.seq_axes(mesh)))
        return jax.sharding.reshard(y, self._act_spec(mesh, 2))[:, :-1]

    def get_logprobs(self, params: Params, tokens: jax.Array, seq_lens: jax.Array, temperature: float = 1.0,
                     expert_ids: jax.Array | None = None) -> jax.Array:
        """[B, T] tokens -> [B, T-1] log p(tokens[:, t+1] | tokens[:, :t+1]) under softmax(logits / temperature).

        Positions at or past seq_lens-1 are 0. Temperature semantics: see `asyncrl/inference/sampling.py`.
        `expert_ids` [B, T, Lm, k]: a MoE routing to replay (`apply_routed`; -1: the router's own choice)."""
        h, _, _ = self.apply_routed(params, tokens, seq_lens, apply_lm_head=False, expert_ids=expert_ids)
        h = h / (temperature if temperature > 0 else 1.0)  # [B, T, D]; (h / t) @ W == logits / t
        B, T, _ = h.shape
        # The fused LM head never materialises [B, T, V] logits (the trainer's path, see ops/logprobs.py).
        lp = fused_linear_selection(self.flatten_positions(h), self.lm_head_weight(params),
                                    self.flatten_positions(self.next_token_targets(tokens)), _LOGPROB_CHUNK)
        valid = jnp.arange(T - 1)[None, :] < (seq_lens[:, None] - 1)
        return jnp.where(valid, self.drop_last_position(lp, B), 0.0)

    # ---- params helpers -------------------------------------------------------------------------------------

    def init_params(self, key: jax.Array, dtype: Any = jnp.float32, mesh: jax.sharding.Mesh | None = None) -> Params:
        shardings = None if mesh is None else self.param_shardings(mesh, dtype)
        return params_lib.init_params(self.cfg, key, dtype, shardings)

    def param_shardings(self, mesh: jax.sharding.Mesh, dtype: Any = jnp.float32) -> Params:
        return params_lib.param_shardings(self.cfg, mesh, self.rules or ShardingRules(), dtype)

    def with_rules(self, rules: ShardingRules | None) -> Model:
        return dataclasses.replace(self, rules=rules)

    def with_remat(self, remat: bool, policy: str = "full") -> Model:
        return dataclasses.replace(self, remat=remat, remat_policy=policy)

    def with_flash(self, flash: bool) -> Model:
        return dataclasses.replace(self, flash=flash)
