"""The weights a replica decodes with: placed on its devices, laid out for its backend, swapped under a lock."""

from __future__ import annotations

import threading
from typing import Any

import jax
from jax.sharding import NamedSharding

from asyncrl.inference.layout import Layout, cpu_decode_layout
from asyncrl.models import dense


def place_params(params: Any, shardings: Any) -> Any:
    """Put params on a replica's layout. Where a leaf already holds a full copy on each target device (what the
    weight-sync hop chain delivers), the replica's array is a zero-copy view of those buffers."""

    def one(x: jax.Array, sh: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and all(e is None for e in sh.spec):
            by_dev = {s.device: s.data for s in x.addressable_shards if s.data.shape == x.shape}
            targets = list(sh.mesh.devices.flat)
            if all(d in by_dev for d in targets):
                return jax.make_array_from_single_device_arrays(x.shape, sh, [by_dev[d] for d in targets])
        return jax.device_put(x, sh)

    return jax.tree.map(one, params, shardings)


class Weights:
    """The current (params, version). Thread-safe: `set` runs on the weight-sync thread, `snapshot` on the decode
    thread before each device call (rows in flight continue with the new weights; their versions record it)."""

    def __init__(self, layout: Layout, params: Any, version: int):
        self.layout = layout
        self._lock = threading.Lock()
        self.params, self.version = self._prepare(self._place(params)), version

    def set(self, params: Any, version: int) -> None:
        """Swap weights, given in any placement (the hop chain's delivery: a zero-copy view of it where it already
        sits on this replica's devices)."""
        params = self._prepare(self._place(params))
        with self._lock:
            self.params, self.version = params, version

    def snapshot(self) -> tuple[Any, int]:
        with self._lock:
            return self.params, self.version

    def _place(self, params: Any) -> Any:
        mesh = self.layout.mesh
        if params is None or mesh is None:
            return params
        return place_params(params, self.layout.model.param_shardings(mesh))

    def _prepare(self, params: Any) -> Any:
        """The weights as this replica decodes with them, made once per weight sync. On the CPU:
        - bf16/f16 leaves become f32: XLA:CPU has no fast half-precision matmul and would otherwise convert every
          layer's weights on every step;
        - the stacked layers are split into per-layer arrays (`params.unstack_layers`): a scan over stacked
          weights copies each layer's slice before its matmuls on every step, a second pass over all weights;
        - each matrix is stored transposed, output dims first (`models/dense.py`): XLA:CPU's small-batch
          matmul is faster that way round.
        Other backends decode with the trainer's tree as it is (TPU fuses the slice into the matmul)."""
        if params is None or not self.layout.cpu or dense.is_output_major(params):
            return params
        cfg = self.layout.model.cfg
        if self.layout.mesh is None:
            return cpu_decode_layout(params, cfg)
        with jax.set_mesh(self.layout.mesh):
            return cpu_decode_layout(params, cfg)
