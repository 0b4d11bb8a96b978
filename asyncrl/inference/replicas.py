"""A host's inference replicas: local devices split into groups of `tp`, one engine (and thread) per group,
or one SPMD engine over a `dp x tp` mesh.

'threads' is the blog's default: replicas never talk to each other, so each runs its own decode loop on its own
devices. 'spmd' is the alternative the blog measured: the decode batch is sharded over `dp` and the row
substitution is a `shard_map` that only touches the device holding the row.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.models.transformer import Model
from asyncrl.rollout import Rollout
from asyncrl.sharding.rules import tensor_parallel_rules

log = logging.getLogger(__name__)


def replica_meshes(devices: Sequence[Any], tp: int) -> list[Mesh]:
    devs = np.asarray(devices)
    if devs.size % tp != 0:
        raise ValueError(f"inference.tp={tp} does not divide the {devs.size} local devices")
    return [Mesh(g, ("tp",), axis_types=(AxisType.Explicit,)) for g in devs.reshape(-1, tp)]


def spmd_mesh(devices: Sequence[Any], tp: int) -> Mesh:
    devs = np.asarray(devices)
    if devs.size % tp != 0:
        raise ValueError(f"inference.tp={tp} does not divide the {devs.size} local devices")
    return Mesh(devs.reshape(-1, tp), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Explicit))


class ReplicaSet:
    """All replicas of one host. `generate` is the offline/eval entry; `serve` runs them continuously.

    With `params=None` the set is built abstractly: engines, meshes, shardings and jitted programs exist but no
    array is allocated (what `launch.py aot` compiles); weights arrive later through `set_params`."""

    def __init__(
        self,
        model: Model,
        params: Any,
        cfg: InferenceConfig,
        tokenizer: Tokenizer | None,
        *,
        devices: Sequence[Any] | None = None,
        seed: int = 0,
        version: int = 0,
        eos_id: int | None = None,
        name: str = "host",
        substitute: str = "auto",
        stop: Sequence[Sequence[int]] = (),
        record_routes: bool = False,
    ):
        """`stop`: token sequences that end a model turn besides EOS (named by the run's environments).
        `record_routes`: train.moe.router_replay (`Engine`)."""
        self.cfg = cfg
        devices = list(devices) if devices is not None else jax.local_devices()
        self.engines: list[Engine] = []
        if cfg.replica_mode == "spmd":
            mesh = spmd_mesh(devices, cfg.tp)
            dp = mesh.shape["dp"]
            if cfg.max_decode_batch_size % dp != 0:
                raise ValueError(
                    f"inference.max_decode_batch_size={cfg.max_decode_batch_size} must divide over dp={dp}")
            m = model.with_rules(tensor_parallel_rules("tp", data_axis="dp"))
            self.engines.append(Engine(m, params, cfg, tokenizer, eos_id=eos_id, mesh=mesh, seed=seed, version=version,
                                       name=f"{name}/spmd", substitute=substitute, stop=stop,
                                       record_routes=record_routes))
        else:
            for i, mesh in enumerate(replica_meshes(devices, cfg.tp)):
                m = model.with_rules(tensor_parallel_rules("tp"))
                self.engines.append(Engine(m, params, cfg, tokenizer, eos_id=eos_id, mesh=mesh, seed=seed,
                                           version=version, name=f"{name}/r{i}", stop=stop,
                                           record_routes=record_routes))

    def __len__(self) -> int:
        return len(self.engines)

    def set_params(self, params: Any, version: int) -> None:
        for e in self.engines:
            e.set_params(params, version)

    def generate(self, requests: Sequence[Request], on_group: Callable[[Rollout], None] | None = None) -> list[Rollout]:
        """Sample every request; rollouts come back in request order."""
        order = {id(r.prompt): i for i, r in enumerate(requests)}
        if len(order) < len(requests):
            raise ValueError("ReplicaSet.generate: two requests share one Prompt object; give each its own")
        chunks: queue.Queue[list[Request]] = queue.Queue()
        step = self.cfg.max_prefill_prompts
        for s in range(0, len(requests), step):
            chunks.put(list(requests[s : s + step]))
        results: list[Rollout] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def collect(r: Rollout) -> None:
            with lock:
                results.append(r)
                if on_group is not None:
                    on_group(r)

        def work(engine: Engine) -> None:
            try:
                while True:
                    try:
                        chunk = chunks.get_nowait()
                    except queue.Empty:
                        break
                    engine.generate(chunk, drain=False, on_group=collect)
                engine.generate([], drain=True, on_group=collect)
            except BaseException as e:  # surfaced to the caller below, never swallowed
                errors.append(e)

        threads = [threading.Thread(target=work, args=(e,), name=e.name, daemon=True) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        results.sort(key=lambda r: order[id(r.prompt)])
        return results
