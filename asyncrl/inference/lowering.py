"""The ahead-of-time side of a replica's programs: every program of `DecodePrograms` and `ParkPrograms`, lowered from
abstract values only (what `launch.py aot` compiles for a TPU slice), with the shapes and layouts of its inputs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncrl.inference.layout import Layout, cpu_decode_layout
from asyncrl.inference.parking import ParkPrograms
from asyncrl.inference.programs import DecodePrograms
from asyncrl.inference.state import DecodeState
from asyncrl.models import lora as lora_lib, params as params_lib
from asyncrl.models.kvcache import KVCache
from asyncrl.sharding.rules import ShardingRules


class AbstractPrograms:
    """The programs of one replica (`decode`; `parking`, None for a single-turn one) on abstract inputs."""

    def __init__(self, layout: Layout, decode: DecodePrograms, parking: ParkPrograms | None):
        self.layout, self.programs, self.parking = layout, decode, parking
        self.cfg, self.model, self.mesh, self.cpu = layout.cfg, layout.model, layout.mesh, layout.cpu
        self.B, self.P, self.Q, self.F = layout.B, layout.P, layout.Q, layout.F

    def abstract_params(self) -> Any:
        """ShapeDtypeStructs of the weights this replica decodes with (`inference.params_dtype`, its layout; on
        the CPU what `Weights.set` makes of them: per-layer, half precision as float32, matrices output-major)."""
        dtype = jnp.dtype(self.cfg.params_dtype)
        shapes = params_lib.shapes(self.model.cfg, dtype)
        if self.mesh is not None:
            shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                                  self.model.param_shardings(self.mesh, dtype))
        if not self.cpu:
            return shapes
        layout = lambda p: cpu_decode_layout(p, self.model.cfg)  # noqa: E731
        if self.mesh is None:
            return jax.eval_shape(layout, shapes)
        with jax.set_mesh(self.mesh):
            return jax.eval_shape(layout, shapes)

    def abstract_state(self, rows: int | None = None, split_rows: bool = True) -> DecodeState:
        """ShapeDtypeStructs of a decode state (`rows` = max_decode_batch_size) or, with split_rows=False, of a
        prefill batch, on the layouts the compiled programs pin."""
        rows = self.B if rows is None else rows
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        if self.mesh is None:
            return jax.eval_shape(lambda k: self.layout.empty(rows, k, split_rows), key)
        with jax.set_mesh(self.mesh):
            shapes = jax.eval_shape(lambda k: self.layout.empty(rows, k, split_rows), key)
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                            self.layout.state_shardings(rows, split_rows))

    def _scalar(self, dtype: Any) -> jax.ShapeDtypeStruct:
        sh = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.ShapeDtypeStruct((), dtype, sharding=sh)

    def lower_decode(self, params: Any = None) -> jax.stages.Lowered:
        """The decode loop with row substitution (`decode_and_swap`), lowered on abstract inputs. `params`: other
        abstract weights to decode with (e.g. `abstract_params_with_lora`, the unmerged-adapter alternative)."""
        params = self.abstract_params() if params is None else params
        return self._lower(self.programs.decode, (params, self.abstract_state(), *self._decode_inputs()))

    def _decode_inputs(self) -> tuple:
        """`decode_and_swap`'s inputs after the weights and the state: the prefill batch, the park store (None in a
        single-turn engine) and the host values."""
        i32 = lambda: self._scalar(jnp.int32)  # noqa: E731
        sh = None if self.mesh is None else NamedSharding(self.mesh, P())
        feed = jax.ShapeDtypeStruct((self.F,), jnp.int32, sharding=sh)
        scalars = (i32(), i32(), i32(), self._scalar(jnp.uint32), i32(), i32(), self._scalar(jnp.bool_), i32(), feed,
                   i32())
        park = self.abstract_park() if self.Q else None
        return (self.abstract_state(self.P, split_rows=False), park, *scalars)

    # ---- LoRA (train.lora): what inference does with adapters ----------------------------------------------

    def abstract_lora(self, lora_cfg: lora_lib.AdapterSpec) -> Any:
        """The adapters as a sync delivers them (inference.params_dtype), on this replica's layout."""
        dtype = jnp.dtype(self.cfg.params_dtype)
        shapes = lora_lib.shapes(self.model.cfg, lora_cfg.rank, lora_cfg.targets, dtype)
        if self.mesh is None:
            return shapes
        sh = lora_lib.shardings(self.model.cfg, lora_cfg.rank, lora_cfg.targets, self.mesh,
                                self.model.rules or ShardingRules(), dtype)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, sh)

    def abstract_params_with_lora(self, lora_cfg: lora_lib.AdapterSpec) -> Any:
        """The weights with unmerged adapters attached (`lora.attach`): stacked layouts only (not the CPU one)."""
        return lora_lib.attach(self.abstract_params(), self.abstract_lora(lora_cfg), lora_cfg.scale)

    def lower_decode_keeping_base(self) -> jax.stages.Lowered:
        """The decode loop as a merge-on-receipt replica runs it: the LoRA base it merges from stays resident beside
        the merged weights, as a donated pass-through, so that the compiled peak counts both copies."""
        base = self.abstract_params()
        state_sh = self.layout.state_shardings(self.B)
        keep_sh = None if self.mesh is None else jax.tree.map(lambda x: x.sharding, base)
        fn = jax.jit(lambda keep, *args: (self.programs._decode_and_swap(*args), keep), donate_argnums=(0, 2),
                     out_shardings=None if state_sh is None else ((state_sh, None), keep_sh))
        return self._lower(fn, (base, self.abstract_params(), self.abstract_state(), *self._decode_inputs()))

    def lower_lora_merge(self, lora_cfg: lora_lib.AdapterSpec) -> jax.stages.Lowered:
        """Merge-on-receipt, once per sync: the kept base plus alpha/r A B, cast back to the decode dtype."""
        dtype, scale = jnp.dtype(self.cfg.params_dtype), lora_cfg.scale
        base = self.abstract_params()
        fn = jax.jit(lambda b, a: params_lib.cast(lora_lib.merge(b, a, scale), dtype),
                     out_shardings=jax.tree.map(lambda x: x.sharding, base) if self.mesh is not None else None)
        return self._lower(fn, (base, self.abstract_lora(lora_cfg)))

    def lower_park(self) -> jax.stages.Lowered:
        """The park program (multi-turn engines only): a decode row's cache into a park row."""
        if not self.Q:
            raise ValueError("the park program belongs to multi-turn engines (inference.max_turns > 1)")
        i32 = lambda: self._scalar(jnp.int32)  # noqa: E731
        return self._lower(self.parking.park, (self.abstract_state().kv, self.abstract_park(), i32(), i32()))

    def abstract_park(self) -> KVCache:
        """ShapeDtypeStructs of the park store, on its layout."""
        rows = self.abstract_state(self.Q, split_rows=False)
        return rows.kv

    def lower_extend(self, bucket: int, rows: int | None = None) -> jax.stages.Lowered:
        """The extend program for `rows` (default max_prefill_prompts) continuations padded to `bucket` tokens
        (multi-turn engines only)."""
        if not self.Q:
            raise ValueError("the extend program belongs to multi-turn engines (inference.max_turns > 1)")
        sh = None if self.mesh is None else NamedSharding(self.mesh, P())
        i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)  # noqa: E731
        rows = self.P if rows is None else rows
        args = (self.abstract_params(), self.abstract_park(), i32((rows,)), i32((rows, bucket)), i32((rows,)),
                i32((rows,)), self._scalar(jnp.int32))
        return self._lower(self.parking.extend, args)

    def lower_prefill(self, bucket: int) -> jax.stages.Lowered:
        """The prefill program for prompts padded to `bucket` tokens, lowered on abstract inputs."""
        sh = None if self.mesh is None else NamedSharding(self.mesh, P())
        args = (self.abstract_params(), jax.ShapeDtypeStruct((self.P, bucket), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((self.P,), jnp.int32, sharding=sh), self._scalar(jnp.int32))
        return self._lower(self.programs.prefill, args)

    def _lower(self, fn: Any, args: tuple) -> jax.stages.Lowered:
        if self.mesh is None:
            return fn.lower(*args)
        with jax.set_mesh(self.mesh):
            return fn.lower(*args)

