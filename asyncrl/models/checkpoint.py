"""Hugging Face checkpoint I/O as a table: HF tensor name <-> param leaf, with a layout transform per entry.

Loading places every leaf straight onto its target sharding with `jax.make_array_from_callback`: each device's
callback reads only the layers (and the slice) it holds from the memory-mapped safetensors, so the full model
is never materialized on one device (nor, per leaf, in host memory beyond one layer at a time).

A mixture-of-experts model (Qwen3-MoE) is stored as transformers writes it: per expert,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, and the router `mlp.gate.weight` [E, D]; our leaves stack the
experts ([L, E, ...]). Its layers live in two stacks (`Params.layers`: the MoE layers, `Params.dense_layers`:
the dense-MLP ones), so a stacked entry reads the HF layer indices of its own stack (`_layer_ids`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from asyncrl.models import params as params_lib
from asyncrl.models.config import ModelConfig
from asyncrl.models.params import Params, ParamSpec
from asyncrl.models.safetensors_io import SafetensorsFile, save_file
from asyncrl.models.transformer import Model
from asyncrl.sharding.host import to_host
from asyncrl.sharding.rules import ShardingRules

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that doesn't match the config; the message names the file and tensor."""


@dataclass(frozen=True)
class Entry:
    """One row of the table. `hf` may contain `{i}` (layer index) and `{e}` (expert index); the leaf is then
    stacked over layers, then experts."""

    leaf: str  # dotted path in Params, e.g. "layers.wq"
    hf: str
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]  # HF layout -> our layout (one layer)
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]  # our layout -> HF layout (one layer)


def _same(x: np.ndarray, c: ModelConfig) -> np.ndarray:
    return x


def _t(x: np.ndarray, c: ModelConfig) -> np.ndarray:
    return x.T


def _heads_in(n_heads: Callable[[ModelConfig], int]) -> tuple[Callable, Callable]:
    # HF projection [N*Dh, D] <-> ours [D, N, Dh].
    def to_ours(x, c):
        return x.T.reshape(c.hidden_size, n_heads(c), c.head_dim)

    def to_hf(x, c):
        return x.reshape(c.hidden_size, -1).T

    return to_ours, to_hf


_Q = _heads_in(lambda c: c.num_heads)
_KV = _heads_in(lambda c: c.num_kv_heads)


def _o_ours(x, c):  # HF [D, H*Dh] -> ours [H, Dh, D]
    return x.T.reshape(c.num_heads, c.head_dim, c.hidden_size)


def _o_hf(x, c):
    return x.reshape(-1, c.hidden_size).T


TABLE: tuple[Entry, ...] = (
    Entry("embed", "model.embed_tokens.weight", _same, _same),
    Entry("layers.attn_norm", "model.layers.{i}.input_layernorm.weight", _same, _same),
    Entry("layers.wq", "model.layers.{i}.self_attn.q_proj.weight", *_Q),
    Entry("layers.wk", "model.layers.{i}.self_attn.k_proj.weight", *_KV),
    Entry("layers.wv", "model.layers.{i}.self_attn.v_proj.weight", *_KV),
    Entry("layers.wo", "model.layers.{i}.self_attn.o_proj.weight", _o_ours, _o_hf),
    Entry("layers.q_norm", "model.layers.{i}.self_attn.q_norm.weight", _same, _same),
    Entry("layers.k_norm", "model.layers.{i}.self_attn.k_norm.weight", _same, _same),
    Entry("layers.mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", _same, _same),
    Entry("layers.w_gate", "model.layers.{i}.mlp.gate_proj.weight", _t, _t),
    Entry("layers.w_up", "model.layers.{i}.mlp.up_proj.weight", _t, _t),
    Entry("layers.w_down", "model.layers.{i}.mlp.down_proj.weight", _t, _t),
    Entry("layers.moe.router", "model.layers.{i}.mlp.gate.weight", _t, _t),
    Entry("layers.moe.w_gate", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", _t, _t),
    Entry("layers.moe.w_up", "model.layers.{i}.mlp.experts.{e}.up_proj.weight", _t, _t),
    Entry("layers.moe.w_down", "model.layers.{i}.mlp.experts.{e}.down_proj.weight", _t, _t),
    Entry("final_norm", "model.norm.weight", _same, _same),
    Entry("lm_head", "lm_head.weight", _t, _t),
)
# A MoE model's dense-MLP layers: the same per-layer rows, read into `dense_layers`.
TABLE += tuple(Entry("dense_" + e.leaf, e.hf, e.to_ours, e.to_hf) for e in TABLE
               if e.leaf.startswith("layers.") and not e.leaf.startswith("layers.moe."))


def _get_leaf(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = None if tree is None else getattr(tree, part)
    return tree


def _stacked(e: Entry) -> bool:
    return "{i}" in e.hf


def _lead(e: Entry) -> int:
    """How many leading leaf dims index HF tensors: 0, 1 (layers) or 2 (layers, experts)."""
    return int("{i}" in e.hf) + int("{e}" in e.hf)


def _layer_ids(e: Entry, cfg: ModelConfig) -> tuple[int, ...]:
    """The HF layer index of each row of a stacked leaf."""
    if e.leaf.startswith("dense_layers."):
        return cfg.dense_layers
    return cfg.sparse_layers if cfg.is_moe else tuple(range(cfg.num_layers))


def _names(e: Entry, cfg: ModelConfig) -> list[str]:
    """Every HF tensor of a leaf, in its rows' order."""
    if not _stacked(e):
        return [e.hf]
    experts = range(cfg.num_experts) if "{e}" in e.hf else [None]
    return [e.hf.format(i=i, e=x) for i in _layer_ids(e, cfg) for x in experts]


def _active_entries(cfg: ModelConfig) -> list[tuple[Entry, ParamSpec]]:
    spec_tree = params_lib.abstract(cfg)
    return [(e, _get_leaf(spec_tree, e.leaf)) for e in TABLE if _get_leaf(spec_tree, e.leaf) is not None]


def _hf_shape(e: Entry, spec: ParamSpec, cfg: ModelConfig) -> tuple[int, ...]:
    layer_shape = spec.shape[_lead(e):]
    return e.to_hf(np.empty(layer_shape, np.uint8), cfg).shape


class _TensorIndex:
    """HF tensor name -> the file that holds it (single file or sharded with an index)."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: no 'weight_map' object")
            for name, fname in weight_map.items():
                self.where[name] = os.path.join(folder, fname)
            for path in sorted(set(self.where.values())):
                if not os.path.isfile(path):
                    raise CheckpointError(f"{index_path}: shard {os.path.basename(path)} is listed but missing")
                self.files[path] = SafetensorsFile(path)
        elif os.path.isfile(single):
            f = SafetensorsFile(single)
            self.files[single] = f
            self.where = {k: single for k in f.keys()}
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")

    def file(self, name: str) -> SafetensorsFile:
        return self.files[self.where[name]]

    def check(self, name: str, expected: tuple[int, ...]) -> None:
        if name not in self.where:
            where = "model.safetensors.index.json" if len(self.files) > 1 else os.path.basename(next(iter(self.files)))
            raise CheckpointError(f"{os.path.join(self.folder, where)}: tensor {name!r} is missing")
        got = self.file(name).shape(name)
        if tuple(got) != tuple(expected):
            raise CheckpointError(f"{self.where[name]}: tensor {name!r} has shape {tuple(got)}, "
                                  f"expected {tuple(expected)}")


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
) -> tuple[Model, Params]:
    """Read a Hugging Face folder (config.json + safetensors) into (Model, Params).

    With `mesh`, each leaf is placed on `rules` (default: replicated) as it is read; otherwise on the default
    device."""
    path = os.fspath(path)
    cfg = ModelConfig.from_hf_folder(path)
    model = Model(cfg, rules)
    index = _TensorIndex(path)
    entries = _active_entries(cfg)
    # Validate everything before reading any bytes: a bad checkpoint fails in milliseconds, not mid-load.
    for e, spec in entries:
        for n in _names(e, cfg):
            index.check(n, _hf_shape(e, spec, cfg))
    np_dtype = np.dtype(jnp.dtype(dtype))
    shardings = model.param_shardings(mesh, dtype) if mesh is not None else None
    leaves: dict[str, jax.Array] = {}
    for e, spec in entries:
        # Without a mesh: this process's first device (jax.devices()[0] belongs to process 0 in a multi-host job).
        sharding = (_get_leaf(shardings, e.leaf) if shardings is not None
                    else SingleDeviceSharding(jax.local_devices()[0]))
        leaves[e.leaf] = _load_leaf(index, e, spec, cfg, sharding, np_dtype)
    return model, _fill(params_lib.abstract(cfg), leaves)


def _load_leaf(index: _TensorIndex, e: Entry, spec: ParamSpec, cfg: ModelConfig, sharding: Any,
               np_dtype: np.dtype) -> jax.Array:
    def read(name: str, rest: tuple[slice, ...]) -> np.ndarray:
        raw = index.file(name).get(name)
        return np.asarray(e.to_ours(raw, cfg)[rest]).astype(np_dtype)

    def callback(idx: tuple[slice, ...]) -> np.ndarray:
        idx, lead = tuple(idx), _lead(e)
        if lead == 0:
            return read(e.hf, idx)
        layers = _layer_ids(e, cfg)[idx[0]]
        if lead == 1:
            return np.stack([read(e.hf.format(i=i), idx[1:]) for i in layers])
        experts = range(cfg.num_experts)[idx[1]]  # an expert-parallel shard reads only its own experts
        return np.stack([np.stack([read(e.hf.format(i=i, e=x), idx[2:]) for x in experts]) for i in layers])

    return jax.make_array_from_callback(spec.shape, sharding, callback)


def _fill(tree: Params, leaves: dict[str, jax.Array]) -> Params:
    """The abstract tree with each ParamSpec replaced by the leaf loaded for its dotted path."""
    return jax.tree_util.tree_map_with_path(lambda path, _: leaves[jax.tree_util.keystr(path)[1:]], tree,
                                            is_leaf=lambda x: isinstance(x, ParamSpec))


def save_pretrained(
    model: Model,
    params: Params,
    path: str | os.PathLike,
    dtype: Any = None,
    max_shard_bytes: int | None = None,
    copy_files_from: str | None = None,
) -> None:
    """Write `params` in the HF layout (safetensors + config.json) that transformers and vLLM read.

    `dtype` casts on the way out (default: the params' dtype); `max_shard_bytes` splits into several files
    with an index; `copy_files_from` copies tokenizer/generation files from a source HF folder."""
    path = os.fspath(path)
    cfg = model.cfg
    tensors: dict[str, np.ndarray] = {}
    for e, _spec in _active_entries(cfg):
        leaf = _get_leaf(params, e.leaf)
        arr = to_host(leaf)
        if dtype is not None:
            arr = arr.astype(np.dtype(jnp.dtype(dtype)))
        rows = arr.reshape(-1, *arr.shape[_lead(e):])  # [layers * experts, ...] in `_names` order
        for name, row in zip(_names(e, cfg), rows, strict=True):
            tensors[name] = e.to_hf(row, cfg)
    if jax.process_index() != 0:  # every process gathers (collectives); process 0 alone writes
        return
    os.makedirs(path, exist_ok=True)
    out_dtype = next(iter(tensors.values())).dtype
    torch_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(str(out_dtype), "float32")
    if max_shard_bytes is None or sum(t.nbytes for t in tensors.values()) <= max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        shards: list[dict[str, np.ndarray]] = [{}]
        for name, t in tensors.items():
            if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > max_shard_bytes:
                shards.append({})
            shards[-1][name] = t
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname))
            weight_map.update({n: fname for n in shard})
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(torch_dtype), f, indent=2)
    if copy_files_from:
        for fname in os.listdir(copy_files_from):
            if fname.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template", "vocab",
                                 "merges")):
                shutil.copy(os.path.join(copy_files_from, fname), os.path.join(path, fname))


