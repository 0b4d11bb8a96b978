"""LoRA: low-rank adapters on the decoder's projections, as one more weight form the model's matmuls read.

A targeted projection W [*in, *out] (wq [D, H, Dh], wo [H, Dh, D], w_down [F, D], ...) gets A [*in, r] and
B [r, *out]; the layer computes y = x W + scale (x A) B with scale = alpha / r (PEFT's convention, so the export
loads into `peft` unchanged). `attach` wraps each targeted weight as a `LoraWeight` leaf-group that the model's
matmul helpers dispatch on (`dense.einsum`, `Model._project_heads`, `Model._contract`): the adapters are applied
unmerged, so the backward pass never forms a [*in, *out] gradient, and the base W stays a frozen input of the
step. `merge` folds them in (W + scale A B), once per weight sync, for the inference engine.

Adapters are a plain dict pytree, stacked over layers like the params: {"wq": {"a": [L, D, r], "b": [L, r, H, Dh]},
...}. Their logical axes are the base weight's on each side of "lora_rank" (never split: r is small), so one
sharding table covers them, its size floor too: under FSDP the factor holding the split dim (D by default: A of
q/k/v/gate/up, B of o/down) is split like W's only when it reaches `min_bytes_for_fsdp`; under tensor parallelism
B's heads are.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from asyncrl.models import params as params_lib
from asyncrl.models.config import ModelConfig
from asyncrl.models.params import Params, ParamSpec
from asyncrl.sharding.rules import ShardingRules, tree_shardings

# Config names (PEFT's module names less "_proj") -> LayerParams fields, in the layer's order.
TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
# Contracted (input) dims of each LayerParams matrix, after a stacked leading [L]: wo [H, Dh, D] contracts (H, Dh);
# the others contract their first. (The CPU decode layout, `dense.cpu_decode_layer`, reads it too.)
class AdapterSpec(Protocol):
    """What the model's programs need of a LoRA config: the adapters' rank, targets and output scale.
    `train.config.LoraConfig` is one; a protocol, so that inference/ (which may not import train/) types it."""

    @property
    def rank(self) -> int: ...

    @property
    def targets(self) -> Sequence[str]: ...

    @property
    def scale(self) -> float: ...


N_IN = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
# The torch module each field is in a Hugging Face Llama/Qwen3 model (PEFT's keys follow them).
HF_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
              "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}

Adapters = dict[str, dict[str, Any]]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeight:
    """A base weight with its adapter pair: computes x W + scale (x A) B. `w` may itself be any weight form the
    matmul helpers read (a plain array, or the engine's `OutputMajor`)."""

    w: Any
    a: Any  # [*in, r]
    b: Any  # [r, *out]
    scale: float = field(metadata=dict(static=True))


def fields(targets: tuple[str, ...] | list[str]) -> list[str]:
    """Config target names -> LayerParams fields, in layer order; an unknown name raises naming it."""
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"train.lora.targets: unknown {bad}; choose from {list(TARGETS)}")
    return [f for t, f in TARGETS.items() if t in targets]


def abstract(cfg: ModelConfig, rank: int, targets: tuple[str, ...] | list[str]) -> Adapters:
    """The adapters' ParamSpecs: A takes W's input dims, B its output dims, each with W's logical axes."""
    layers = params_lib.abstract(cfg).layers
    out: Adapters = {}
    for f in fields(targets):
        s: ParamSpec = getattr(layers, f)
        n = 1 + N_IN[f]  # the leading [L] and the input dims
        fan_in = int(np.prod(s.shape[1:n]))
        out[f] = {"a": ParamSpec((s.shape[0], *s.shape[1:n], rank), ("layers", *s.axes[1:n], "lora_rank"), "lora_a",
                                 fan_in=fan_in),
                  "b": ParamSpec((s.shape[0], rank, *s.shape[n:]), ("layers", "lora_rank", *s.axes[n:]), "zeros")}
    return out


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def shapes(cfg: ModelConfig, rank: int, targets: Any, dtype: Any = jnp.float32) -> Adapters:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), abstract(cfg, rank, targets), is_leaf=_is_spec)


def shardings(cfg: ModelConfig, rank: int, targets: Any, mesh: Any, rules: ShardingRules,
              dtype: Any = jnp.float32) -> Adapters:
    axes = jax.tree.map(lambda s: s.axes, abstract(cfg, rank, targets), is_leaf=_is_spec)
    return tree_shardings(rules, mesh, shapes(cfg, rank, targets, dtype), axes)


def init(cfg: ModelConfig, rank: int, targets: Any, key: jax.Array, dtype: Any = jnp.float32) -> Adapters:
    """A uniform in +-1/sqrt(fan_in) (PEFT's default, Kaiming-uniform with a = sqrt(5)), B zero: the adapted model
    starts exactly at the base."""
    specs = abstract(cfg, rank, targets)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(s: ParamSpec, k: jax.Array) -> jax.Array:
        if s.init == "zeros":
            return jnp.zeros(s.shape, dtype)
        bound = 1.0 / math.sqrt(s.fan_in)
        return jax.random.uniform(k, s.shape, jnp.float32, -bound, bound).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def attach(params: Params, adapters: Adapters, scale: float) -> Params:
    """`params` with each targeted layer weight wrapped as a LoraWeight (stacked or per-layer trees alike)."""

    def wrap(layer: Any, ad: Adapters) -> Any:
        return type(layer)(**{f: LoraWeight(getattr(layer, f), ad[f]["a"], ad[f]["b"], scale) if f in ad
                              else getattr(layer, f) for f in layer.__dataclass_fields__})

    if isinstance(params.layers, tuple):
        per_layer = [jax.tree.map(lambda x, i=i: x[i], adapters) for i in range(len(params.layers))]
        return params_lib.replace(params, layers=tuple(wrap(l, a) for l, a in zip(params.layers, per_layer)))
    return params_lib.replace(params, layers=wrap(params.layers, adapters))


def _pair_eq(a_ndim: int, b_ndim: int, lead: int) -> str:
    """einsum for A [*lead, *in, r] x B [*lead, r, *out] -> [*lead, *in, *out]."""
    letters = iter(string.ascii_letters)
    ld = "".join(next(letters) for _ in range(lead))
    i = "".join(next(letters) for _ in range(a_ndim - lead - 1))
    r = next(letters)
    o = "".join(next(letters) for _ in range(b_ndim - lead - 1))
    return f"{ld}{i}{r},{ld}{r}{o}->{ld}{i}{o}"


def delta_weight(a: jax.Array, b: jax.Array, scale: float, lead: int = 1) -> jax.Array:
    """scale A B in fp32, shaped like the base weight ([L, *in, *out] for stacked adapters, lead=1)."""
    eq = _pair_eq(a.ndim, b.ndim, lead)
    return scale * jnp.einsum(eq, a.astype(jnp.float32), b.astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST)


def merge(params: Params, adapters: Adapters, scale: float) -> Params:
    """W + scale A B for every targeted weight (in fp32, cast back to W's dtype); stacked params only."""
    layers = params.layers
    new = {f: (getattr(layers, f).astype(jnp.float32) + delta_weight(ad["a"], ad["b"], scale)).astype(
        getattr(layers, f).dtype) for f, ad in adapters.items()}
    return params_lib.replace(params, layers=type(layers)(**{f: new.get(f, getattr(layers, f))
                                                              for f in layers.__dataclass_fields__}))


def delta(x: jax.Array, w: LoraWeight, y: jax.Array) -> jax.Array:
    """scale (x A) B for activations x [..., *in], typed and laid out like the base product y [..., *out]."""
    n_in, n_lead = w.a.ndim - 1, x.ndim - (w.a.ndim - 1)
    letters = string.ascii_letters
    ld, i, o = letters[:n_lead], letters[n_lead:n_lead + n_in], letters[n_lead + n_in:n_lead + n_in + w.b.ndim - 1]
    a, b = w.a.astype(x.dtype), w.b.astype(x.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    kw1, kw2 = {}, {}
    if not mesh.empty and mesh.explicit_axes:
        # [..., r] keeps x's split of its rows (a split contracted dim is summed over); the result y's layout.
        kw1["out_sharding"] = P(*jax.typeof(x).sharding.spec[:n_lead], None)
        kw2["out_sharding"] = jax.typeof(y).sharding.spec
    xa = jnp.einsum(f"{ld}{i},{i}Z->{ld}Z", x, a, **kw1)  # Z: the rank (the others are lower case)
    return (jnp.einsum(f"{ld}Z,Z{o}->{ld}{o}", xa, b, **kw2) * jnp.asarray(w.scale, x.dtype)).astype(y.dtype)


def count(cfg: ModelConfig, rank: int, targets: Any, factors: tuple[str, ...] = ("a", "b")) -> int:
    """Adapter values: of both factors, or of `factors` alone (("b",): what a sync with A frozen moves)."""
    return sum(int(np.prod(pair[x].shape)) for pair in abstract(cfg, rank, targets).values() for x in factors)


# ---- A frozen (train.lora.freeze_a) ------------------------------------------------------------------------------
# LoRA-FA (Zhang et al., 2023): A stays at its random init and only B trains. A then needs no gradient and no
# optimizer state, and a weight sync after the first moves B alone: r x out values per projection instead of
# r x (in + out), which is what takes an 8B sync at rank 32 past 100x smaller than the full model's.

def synced(adapters: Adapters, full: bool, freeze_a: bool) -> Adapters:
    """The factors a weight sync moves: both, except that with A frozen only the attempt's first sync (`full`)
    carries A; the receivers keep it, and later syncs carry B alone. Works on any tree shaped like the adapters
    (arrays, shapes, shardings)."""
    if full or not freeze_a:
        return adapters
    return {f: {"b": pair["b"]} for f, pair in adapters.items()}


def with_frozen_a(adapters: Adapters) -> Adapters:
    """The adapters with A cut out of the gradient: XLA then drops the dA matmuls from the backward pass."""
    return {f: {"a": jax.lax.stop_gradient(pair["a"]), "b": pair["b"]} for f, pair in adapters.items()}


def optimizer_labels(adapters: Adapters) -> Adapters:
    """"frozen" for A, "trained" for B: the labels of `optax.multi_transform` when A is frozen."""
    return {f: {"a": "frozen", "b": "trained"} for f in adapters}


# ---- PEFT's format ---------------------------------------------------------------------------------------------

def peft_tensors(cfg: ModelConfig, adapters: Adapters) -> dict[str, np.ndarray]:
    """PEFT's state dict: `base_model.model.model.layers.{i}.<module>.lora_A.weight` [r, in] (= A^T, the input dims
    flattened) and `lora_B.weight` [out, r] (= B^T), fp32. Our heads dims flatten in HF's order ([H, Dh] -> H*Dh),
    the same as the base weights' table in checkpoint.py."""
    out: dict[str, np.ndarray] = {}
    for f, ad in adapters.items():
        a, b = np.asarray(ad["a"], np.float32), np.asarray(ad["b"], np.float32)
        L, r = a.shape[0], a.shape[-1]
        for i in range(L):
            key = f"base_model.model.model.layers.{i}.{HF_MODULES[f]}"
            out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    return out


_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
# adapter_config.json fields that would change what the tensors mean, and the value under which they do not.
_PEFT_NEUTRAL = {"peft_type": "LORA", "use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
                 "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "modules_to_save": None,
                 "layer_replication": None, "target_parameters": None, "exclude_modules": None, "use_qalora": False,
                 "trainable_token_indices": None}


def from_peft_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], rank: int, targets: Any) -> Adapters:
    """The inverse of `peft_tensors`. Every tensor must be placed: one that is missing, has another shape than
    its slot, belongs to a module outside `targets`, or has a name we do not know raises ValueError naming it."""
    specs = abstract(cfg, rank, targets)
    by_module = {m: f for f, m in HF_MODULES.items()}
    out = {f: {"a": np.zeros(p["a"].shape, np.float32), "b": np.zeros(p["b"].shape, np.float32)}
           for f, p in specs.items()}
    unknown, outside, misshapen, placed = [], [], [], set()
    for key in sorted(tensors):
        m = _PEFT_KEY.fullmatch(key)
        if m is None or int(m[1]) >= cfg.num_layers or m[2] not in by_module:
            unknown.append(key)
            continue
        f, side = by_module[m[2]], m[3].lower()
        if f not in out:
            outside.append(key)
            continue
        dst = out[f][side]
        in_dims, out_dims = dst.shape[1:-1], dst.shape[1:]
        want = (rank, int(np.prod(in_dims))) if side == "a" else (int(np.prod(dst.shape[2:])), rank)
        t = np.asarray(tensors[key], np.float32)
        if t.shape != want:
            misshapen.append(f"{key} {tuple(t.shape)} (expected {want})")
            continue
        dst[int(m[1])] = t.T.reshape(out_dims)
        placed.add(key)
    missing = [f"base_model.model.model.layers.{i}.{HF_MODULES[f]}.lora_{s}.weight" for f in out
               for i in range(cfg.num_layers) for s in "AB"]
    missing = [k for k in missing if k not in placed and k not in tensors]
    problems = [(f"tensors outside the targets {sorted(targets)}", outside), ("unknown tensor names", unknown),
                ("tensors of the wrong shape", misshapen), ("missing tensors", missing)]
    problems = [f"{what}: {names[:8]}" + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                for what, names in problems if names]
    if problems:
        raise ValueError("PEFT adapter tensors cannot be placed on this model: " + "; ".join(problems))
    return out


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter as read by `load_peft_adapter`: the adapters and what `adapter_config.json` says."""

    adapters: Adapters
    rank: int
    alpha: float
    targets: tuple[str, ...]
    """Config names (`TARGETS` keys: 'q', 'v', 'down', ...), in layer order."""
    scale: float
    """alpha / r, or alpha / sqrt(r) for an rsLoRA adapter: the `scale` of `attach` and `merge`."""


def load_peft_adapter(path: str, cfg: ModelConfig) -> PeftAdapter:
    """Read a PEFT LoRA adapter folder (`adapter_config.json` and `adapter_model.safetensors`, as
    `PeftModel.save_pretrained` writes them) for a model of `cfg`. Rank, alpha and targets come from the config;
    a config option that changes what the tensors mean (DoRA, per-module ranks, biases, ...) and every tensor that
    cannot be placed (`from_peft_tensors`) raise ValueError naming them."""
    import json
    import os

    from asyncrl.models.safetensors_io import SafetensorsFile

    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        conf = json.load(f)
    for key, neutral in _PEFT_NEUTRAL.items():
        value = conf.get(key, neutral)
        if value != neutral and not (neutral in ({}, None, False) and not value):
            raise ValueError(f"{config_path}: {key}={value!r} is not supported (only {key}={neutral!r})")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in conf:
            raise ValueError(f"{config_path}: {key} is missing")
    rank, alpha, modules = conf["r"], float(conf["lora_alpha"]), conf["target_modules"]
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r={rank!r} is invalid: must be an integer >= 1")
    by_proj = {HF_MODULES[f].split(".")[1]: t for t, f in TARGETS.items()}  # "q_proj" -> "q"
    if modules == "all-linear":  # PEFT's shorthand: every linear layer of the decoder (never the LM head)
        modules = list(by_proj)
    if isinstance(modules, str) or not modules or [m for m in modules if m not in by_proj]:
        raise ValueError(f"{config_path}: target_modules={modules!r} is not supported: must be a list of names from "
                         f"{list(by_proj)} (or 'all-linear')")
    targets = tuple(t for t in TARGETS if t in {by_proj[m] for m in modules})
    f = SafetensorsFile(os.path.join(path, "adapter_model.safetensors"))
    adapters = from_peft_tensors(cfg, {k: f.get(k) for k in f.keys()}, rank, targets)
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora", False) else alpha / rank
    return PeftAdapter(adapters, rank, alpha, targets, scale)


def save_peft(folder: str, cfg: ModelConfig, adapters: Adapters, rank: int, alpha: float,
              base_model: str | None = None) -> None:
    """The adapter alone in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, which
    `peft.PeftModel.from_pretrained(<the transformers base model>, folder)` loads."""
    import json
    import os

    from asyncrl.models.safetensors_io import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(peft_tensors(cfg, adapters), os.path.join(folder, "adapter_model.safetensors"), {"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": sorted({HF_MODULES[f].split(".")[1] for f in adapters}), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_model}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
