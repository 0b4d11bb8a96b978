"""Every program a run executes, built from its config over any device list, without allocating an array.

`build_programs(cfg, devices)` (`cfg`: the sections of the run config they read, `Config.programs_config()`)
splits the devices by host exactly as the run does (`sharding/roles.py`), builds the real `Trainer` and
`ReplicaSet` over them (abstractly: no params, no state), and returns one `Program` per
compiled function the run calls: the train step, the weight-sync cast, the decode loop with row substitution,
and each prefill bucket. Over a TPU topology's devices (`jax.experimental.topologies`) this is what lets a
laptop compile for a slice it does not have.

Each program also carries its *ideal*: the work no implementation can avoid, against which the compiled
figures are judged (`report.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.models import lora as lora_lib
from asyncrl.models.config import ModelConfig
from asyncrl.models.section import ModelSection
from asyncrl.models.sources import model_config
from asyncrl.models.transformer import Model
from asyncrl.sharding.roles import split_roles
from asyncrl.train.batch import round_up
from asyncrl.train.config import LoraConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.trainer import Trainer


@dataclass(frozen=True)
class ProgramsConfig:
    """What the run's programs are built from: the sections of the run config they read (split off it by
    `Config.programs_config()`)."""

    model: ModelSection
    inference: InferenceConfig
    train: TrainConfig
    loss: LossConfig
    sharding: ShardingConfig
    train_workers: int
    """`async.train_workers`: the hosts that train, the rest run inference (`sharding/roles.py`)."""
    hosts: int
    """`run.hosts`: the simulated hosts a one-host slice is cut into, as a local run is."""


@dataclass(frozen=True)
class Program:
    name: str
    role: str
    """'trainer' or 'inference': whose chips run it."""
    chips: int
    """Chips one call spans (a replica's, or the whole trainer mesh)."""
    lower: Callable[[], jax.stages.Lowered]
    tokens: int
    """Tokens one call processes: batch x length for the train step and prefill, rows for a decode step."""
    seq_len: int
    """Sequence length of the call's rows (train: padded T; decode: the cache length; prefill: the bucket)."""
    per: str
    """What one call is: 'step' (train), 'call', or 'decode step' (the data-dependent loop counted once)."""
    ideal_flops: float
    """Useful FLOPs per chip (train: 6 N tokens; prefill: 2 N tokens)."""
    ideal_bytes: float
    """Unavoidable HBM bytes per chip (decode: the weights plus the whole KV cache, read once; of a MoE layer's
    experts only those the step's rows are expected to touch, `experts_touched`)."""


def matmul_params(model: Model) -> int:
    """N of 6·N·tokens: the weights that take part in a token's matmuls, i.e. every layer's projections and the LM
    head (the input embedding is a lookup; norm scales are elementwise). In a mixture-of-experts layer that is the
    *active* params: the router and the k experts the token is routed to, not all E."""
    c = model.cfg
    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    attn = d * (h + 2 * k) * dh + h * dh * d
    if not c.is_moe:
        return c.num_layers * (attn + 3 * d * c.intermediate_size) + d * c.vocab_size
    sparse = d * c.num_experts + c.num_experts_per_tok * 3 * d * c.moe_intermediate_size
    return (c.num_layers * attn + len(c.sparse_layers) * sparse + len(c.dense_layers) * 3 * d * c.intermediate_size
            + d * c.vocab_size)


def experts_touched(cfg: ModelConfig, rows: int) -> float:
    """Expected distinct experts one MoE layer reads in a decode step of `rows` tokens, each routed to k of the E
    experts uniformly: E * (1 - (1 - k/E)^rows) (an expert is missed by one token with probability 1 - k/E). Real
    routers are less uniform, which touches fewer: this ideal is the larger, harder one."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1.0 - (1.0 - k / E) ** rows)


def expert_bytes(params: Any) -> float:
    """Bytes one device holds of the experts' weights (not the routers) of a tree of ShapeDtypeStructs."""
    layers = params.layers if isinstance(params.layers, tuple) else (params.layers,)
    return sum(shard_bytes([m.w_gate, m.w_up, m.w_down]) for m in (x.moe for x in layers) if m is not None)


def shard_bytes(tree: Any) -> float:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (replicated leaves count whole)."""
    total = 0.0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += math.prod(shape) * np.dtype(a.dtype).itemsize
    return total


def synced_values(model_cfg: ModelConfig, lora_cfg: LoraConfig | None) -> int:
    """Values a weight sync after the first moves: every param, or with LoRA (`lora_cfg` enabled) the adapters,
    B alone with `freeze_a`."""
    if lora_cfg is None or not lora_cfg.enabled:
        return model_cfg.num_params()
    return lora_lib.count(model_cfg, lora_cfg.rank, lora_cfg.targets, ("b",) if lora_cfg.freeze_a else ("a", "b"))


def build_programs(cfg: ProgramsConfig, devices: Sequence[Any], only: Sequence[str] | None = None) -> list[Program]:
    """The run's programs over `devices` (every device of the job, all hosts). `only` keeps the programs whose
    name starts with one of its entries (e.g. ['train_step', 'decode'])."""
    # A one-host slice cannot be split by host; it is cut into the config's simulated hosts, as a local run is.
    single = len({d.process_index for d in devices}) == 1
    roles = split_roles(devices, cfg.train_workers, hosts=cfg.hosts if single else None)
    model = Model(model_config(cfg.model), logits_precision=cfg.model.logits_precision)
    n = matmul_params(model)
    programs: list[Program] = []

    trainer = Trainer(model, cfg.train, cfg.loss, cfg.sharding, devices=roles.trainer_devices,
                      temperature=cfg.inference.temperature)
    t_chips = len(roles.trainer_devices)
    T = round_up(cfg.inference.max_seq_len, cfg.train.pad_to_multiple)
    train_tokens = cfg.train.train_batch_size * T
    state = trainer.abstract_state()
    lc = cfg.train.lora if cfg.train.lora.enabled else None
    dtype = jnp.dtype(cfg.inference.params_dtype)
    sync_bytes = synced_values(model.cfg, lc) * dtype.itemsize
    if lc is None:
        train_flops, train_bytes = 6.0 * n * train_tokens, shard_bytes(state)
    else:
        # LoRA: the forward (2N) and the activations' gradient (2N), but no gradient of the frozen base's weights;
        # the adapters' own 6 n_lora (4 n_lora + 2 n_b with A frozen: no gradient of A). The frozen base is
        # resident beside the adapters' state. A sync after the first moves the adapters (B alone with A frozen).
        n_lora = lora_lib.count(model.cfg, lc.rank, lc.targets)
        n_b = lora_lib.count(model.cfg, lc.rank, lc.targets, ("b",))
        train_flops = (4.0 * n + (4.0 * n_lora + 2.0 * n_b if lc.freeze_a else 6.0 * n_lora)) * train_tokens
        train_bytes = shard_bytes(state) + shard_bytes(trainer.abstract_reference())
    programs.append(Program(
        "train_step", "trainer", t_chips, lambda: trainer.lower_step(trainer.abstract_batch(T)), train_tokens, T,
        "step", train_flops / t_chips, train_bytes))

    # The hop chain's first slot is the trainer chips: the sync casts the weights (LoRA: the adapters) into the
    # chain's layout, split over them (`sharding/chain.py`). Ideal: the chip's master shard read, its 1/n of the
    # cast written.
    cast_bytes = shard_bytes(state["params"]) + sync_bytes / t_chips
    programs.append(Program(
        "weight_sync_cast", "trainer", t_chips, lambda: trainer.lower_sync_cast(dtype), 0, 0, "call", 0.0,
        cast_bytes))

    tokenizer = None
    if cfg.inference.reasoning_budget is not None:  # the forced phrase is encoded at build time
        import tempfile

        from asyncrl.models.sources import load_tokenizer

        tokenizer = load_tokenizer(cfg.model, tempfile.mkdtemp(prefix="asyncrl-aot-"))
    replicas = ReplicaSet(model, None, cfg.inference, tokenizer, devices=roles.inference_hosts[0], eos_id=0)
    engine = replicas.engines[0]
    e_chips = engine.mesh.devices.size
    abstract_weights = engine.abstract_params()
    weights = shard_bytes(abstract_weights)
    state_kv = engine.abstract_state().kv
    rows = cfg.inference.max_decode_batch_size
    # A MoE decode step reads the experts its rows are routed to, not all E (`experts_touched`); the rest in full.
    read = weights if not model.cfg.is_moe else (
        weights - expert_bytes(abstract_weights) * (1.0 - experts_touched(model.cfg, rows) / model.cfg.num_experts))
    # With LoRA the replica decodes with merged weights and keeps the base it merges the next adapters into.
    programs.append(Program(
        "decode", "inference", e_chips, engine.lower_decode if lc is None else engine.lower_decode_keeping_base,
        rows, engine.S, "decode step", 2.0 * n * rows / e_chips, read + shard_bytes(state_kv)))
    if lc is not None:  # the two ways to decode with adapters: merged once per sync, or unmerged in every step
        programs.append(Program("lora_merge", "inference", e_chips, lambda: engine.lower_lora_merge(lc), 0, 0, "call",
                                0.0, 2 * weights + shard_bytes(engine.abstract_lora(lc))))
        programs.append(Program(
            "decode_lora_unmerged", "inference", e_chips,
            lambda: engine.lower_decode(engine.abstract_params_with_lora(lc)), cfg.inference.max_decode_batch_size,
            engine.S, "decode step", 2.0 * n * cfg.inference.max_decode_batch_size / e_chips,
            weights + shard_bytes(engine.abstract_lora(lc)) + shard_bytes(state_kv)))
    for b in engine.prefill_buckets():
        tokens = cfg.inference.max_prefill_prompts * b
        programs.append(Program(
            f"prefill[{b}]", "inference", e_chips, lambda b=b: engine.lower_prefill(b), tokens, b, "call",
            2.0 * n * tokens / e_chips, weights))
    if engine.Q:  # multi-turn: a row's cache parked per turn; a continuation appended to it, at every bucket
        park = shard_bytes(engine.abstract_park())
        row_bytes = park / engine.Q
        programs.append(Program("park", "inference", e_chips, engine.lower_park, 1, engine.S, "call", 0.0,
                                2 * row_bytes))  # ideal: one cache row read and written
        for b in engine.extend_buckets():
            tokens = cfg.inference.max_prefill_prompts * b
            # Ideal: the weights, and the history read from the park rows (at most a whole cache row each).
            programs.append(Program(
                f"extend[{b}]", "inference", e_chips, lambda b=b: engine.lower_extend(b), tokens, b, "call",
                2.0 * n * tokens / e_chips, weights + park * cfg.inference.max_prefill_prompts / engine.Q))
    if only:
        programs = [p for p in programs if any(p.name.startswith(o) for o in only)]
    return programs
