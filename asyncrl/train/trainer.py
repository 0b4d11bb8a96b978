"""The trainer's state and its one verb, `step`: params, optimizer state, step count, RNG and weight version.

Free of queues and Ray on purpose: orchestration collects rollouts (`batch.collect_rollouts`), builds the local
batch (`batch.build_batch`), calls `Trainer.step` on every trainer host at once (SPMD), then syncs
`params_for_inference`. Every trainer host builds the same `Trainer` over the same global devices.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.models import lora as lora_lib, moe as moe_lib, params as params_lib
from asyncrl.models.params import Params
from asyncrl.models.transformer import Model
from asyncrl.sharding.chain import chain_shardings
from asyncrl.train.batch import HostMetrics, RLBatch, combine_host_metrics, offset_group_ids, pad_batch
from asyncrl.train.config import ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.mesh import (
    host_allgather,
    make_shardings,
    make_train_mesh,
    shard_batch,
    supports_memory_kind,
    train_rules,
    trainer_processes,
)
from asyncrl.train.optimizer import lr_schedule, make_optimizer
from asyncrl.train.step import make_train_step
from asyncrl.validate import ConfigError

MASTER_DTYPE = jnp.float32
log = logging.getLogger(__name__)


def place(tree: Any, shardings: Any) -> Any:
    """Put `tree` on `shardings`. A trainer mesh that spans several hosts is not addressable from one process, and
    `jax.device_put` refuses host data for it: there each process builds the global array from its own full copy
    of the values (every trainer host holds the same ones: a checkpoint folder, the cached warm-start)."""

    def one(x: Any, sh: Any) -> Any:
        if getattr(sh, "is_fully_addressable", True) or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sh)  # host data for local devices, or a global array resharded
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(one, tree, shardings)


class Trainer:
    """Owns the fp32 master params and AdamW state on the ("dp", "fsdp", "expert", "cp") mesh.

    `version` is the weight version the current params represent: 0 before any step, +1 per step. A rollout's
    lag is `version - rollout.oldest_version` at the time it is trained on.

    With loss.kl_coef > 0 it also keeps `ref_params`, the KL reference: a copy of the params as `init` or `load`
    left them (the policy the run starts from), in the compute dtype, on the param shardings or in pinned host
    memory (train.ref_offload). Restoring a checkpoint does not move it: the run keeps the reference as durable
    state of its own (`set_reference`, `orchestration/trainer_setup.py`)."""

    def __init__(self, model: Model, train_cfg: TrainConfig, loss_cfg: LossConfig, sharding_cfg: ShardingConfig,
                 devices: Sequence[jax.Device] | None = None, temperature: float = 1.0):
        self.train_cfg, self.loss_cfg, self.sharding_cfg = train_cfg, loss_cfg, sharding_cfg
        self.temperature = temperature
        self.mesh = make_train_mesh(sharding_cfg.mesh, devices)
        self.hosts = trainer_processes(self.mesh)
        if jax.process_index() not in self.hosts:
            raise ValueError(f"process {jax.process_index()} owns none of the trainer mesh's devices "
                             f"(trainer processes: {self.hosts})")
        on_tpu = self.mesh.devices.flat[0].platform == "tpu"
        self.model = (model.with_rules(train_rules(sharding_cfg))
                      .with_remat(train_cfg.remat, train_cfg.remat_policy)
                      .with_flash(train_cfg.attention == "flash" or (train_cfg.attention == "auto" and on_tpu)))
        # 'auto' off TPU: cuDNN's fused attention on a GPU where it applies (models/attention_impl.py).
        self.model = dataclasses.replace(self.model, attention_impl="reference" if train_cfg.attention == "reference"
                                         else "auto")
        cp = self.mesh.shape["cp"]
        if cp > 1 and (model.cfg.num_heads % cp or train_cfg.pad_to_multiple % cp):
            raise ValueError(f"sharding.mesh.cp_ulysses={cp} must divide the model's {model.cfg.num_heads} attention "
                             f"heads and train.pad_to_multiple={train_cfg.pad_to_multiple} (Ulysses splits heads and "
                             "every padded sequence over cp)")
        self.schedule = lr_schedule(train_cfg)
        self.base_shardings = self.model.param_shardings(self.mesh, MASTER_DTYPE)
        # LoRA: the trained tree (`params`, the optimizer's, the checkpoints') is the adapters; the model's weights
        # are `base`, frozen, in the compute dtype, on the model's shardings, and with the KL term also the reference.
        self.lora = train_cfg.lora if train_cfg.lora.enabled else None
        if self.lora is not None and model.cfg.is_moe:  # adapters on the experts (models/moe.py): not built yet
            raise ConfigError(f"train.lora.rank={self.lora.rank} (LoRA) is not supported on a mixture-of-experts "
                              f"model (model.family={model.cfg.family!r}, model.num_experts={model.cfg.num_experts}): "
                              "set train.lora.rank=0 for a full fine-tune")
        if self.lora is not None:
            lc = self.lora
            self.params_abstract = lora_lib.shapes(model.cfg, lc.rank, lc.targets, MASTER_DTYPE)
            trained_shardings = lora_lib.shardings(model.cfg, lc.rank, lc.targets, self.mesh, self.model.rules)
            self.tx = make_optimizer(train_cfg, model.cfg, mask=lambda p: jax.tree.map(lambda _: True, p),
                                     labels=lora_lib.optimizer_labels(self.params_abstract) if lc.freeze_a else None)
        else:
            self.params_abstract = params_lib.shapes(model.cfg, MASTER_DTYPE)
            trained_shardings = self.base_shardings
            self.tx = make_optimizer(train_cfg, model.cfg)
        self.shardings = make_shardings(self.mesh, trained_shardings, self.params_abstract, self.tx, sharding_cfg)
        # A sync's payload is cast straight into the hop chain's layout, split over every trainer chip, never whole
        # on one (`sharding/chain.py`). One object per tree: `_cast_fn` keys its programs on it.
        self._sync_shardings = {"params": chain_shardings(self.mesh, params_lib.shapes(model.cfg, MASTER_DTYPE))}
        if self.lora is not None:
            synced = lambda full: lora_lib.synced(self.params_abstract, full, self.lora.freeze_a)  # noqa: E731
            self._sync_shardings |= {full: chain_shardings(self.mesh, synced(full)) for full in (True, False)}
        ep = self.mesh.shape["expert"]
        if ep > 1 and (not model.cfg.is_moe or model.cfg.num_experts % ep):
            raise ConfigError(f"sharding.mesh.expert={ep} splits a mixture-of-experts model's experts: it must divide "
                              f"model.num_experts={model.cfg.num_experts} (model.family={model.cfg.family!r})")
        n_data = self.mesh.shape["dp"] * self.mesh.shape["fsdp"] * ep
        k = train_cfg.updates_per_step
        micro = train_cfg.train_batch_size // (train_cfg.grad_accum_steps * k)
        if micro % n_data:
            raise ValueError(f"train.train_batch_size / (train.updates_per_step x train.grad_accum_steps) = {micro} "
                             f"sequences per micro-batch must divide over the {n_data} data-parallel devices "
                             "(dp x fsdp x expert)")
        compute = None if train_cfg.compute_dtype == "float32" else jnp.dtype(train_cfg.compute_dtype)
        self.ref_dtype = compute or MASTER_DTYPE
        self.ref_shardings, ref_compute = self.base_shardings, None
        if loss_cfg.kl_coef > 0 and train_cfg.ref_offload and self.lora is None:
            if supports_memory_kind(self.mesh, "pinned_host"):
                ref_compute = self.shardings.params
                self.ref_shardings = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), self.shardings.params)
            else:
                log.warning("train.ref_offload: devices %s have no pinned_host memory; the KL reference stays in "
                            "device memory", self.mesh.devices.flat[0].platform)
        self._step_fn = make_train_step(self.model, self.tx, loss_cfg, self.schedule, self.shardings,
                                        train_cfg.grad_accum_steps, temperature, train_cfg.logprob_chunk_size,
                                        compute, k, ref_compute, self.lora, train_cfg.ess_scaled_lr, train_cfg.moe)
        self.replay = train_cfg.moe.router_replay and model.cfg.is_moe  # the batches carry the sampler's expert ids
        self.params: Params | None = None
        self.base: Params | None = None  # LoRA's frozen weights
        self.ref_params: Params | None = None
        self.opt_state: Any = None
        self._cast_fns: dict[Any, Any] = {}
        self.step_count = 0
        self.version = 0
        self.rng: jax.Array | None = None
        # The last step's importance-weight sums per group, [train_batch_size, 4] by global group id (train/ess.py).
        self.group_weights: np.ndarray | None = None

    # ---- state ----------------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> None:
        """Random fp32 params (created in place on their shardings) and a fresh optimizer state."""
        init_key, self.rng = jax.random.split(key)
        # One program for the whole tree (init_params with shardings would compile one per leaf); same values.
        init = lambda k: params_lib.init_params(self.model.cfg, k, MASTER_DTYPE)  # noqa: E731
        with jax.set_mesh(self.mesh):
            params = jax.jit(init, out_shardings=self.base_shardings)(init_key)
        if self.lora is not None:
            self._set_base(params)
            return
        self.params = params
        self._init_opt_state()
        self._keep_reference()

    def _set_base(self, params: Params) -> None:
        """LoRA: `params` become the frozen base (compute dtype); fresh adapters (B = 0: the model starts at the
        base) from the trainer's RNG, the same on every trainer host."""
        lc, dtype = self.lora, self.ref_dtype
        placed = place(params, self.base_shardings)
        if self.rng is None:
            self.rng = jax.random.key(0)
        key = jax.random.fold_in(self.rng, 0x10A)
        init = lambda k: lora_lib.init(self.model.cfg, lc.rank, lc.targets, k, MASTER_DTYPE)  # noqa: E731
        with jax.set_mesh(self.mesh):
            self.base = jax.jit(lambda p: params_lib.cast(p, dtype), out_shardings=self.base_shardings)(placed)
            self.params = jax.jit(init, out_shardings=self.shardings.params)(key)
        self._init_opt_state()

    def load(self, params: Params) -> None:
        """Start from given weights (any dtype/placement): cast to fp32 and moved onto the trainer shardings (with
        LoRA: the frozen base, and fresh adapters)."""
        if self.lora is not None:
            self._set_base(params)
            return
        placed = place(params, self.shardings.params)  # from numpy, another mesh or another dtype
        with jax.set_mesh(self.mesh):
            self.params = self._cast_fn(MASTER_DTYPE)(placed)
        if self.rng is None:
            self.rng = jax.random.key(0)
        self._init_opt_state()
        self._keep_reference()

    def _keep_reference(self) -> None:
        """The KL reference: a copy (the step donates `params`) of the params the run starts from."""
        if self.loss_cfg.kl_coef > 0:
            self.set_reference(self.params)

    def set_reference(self, params: Params) -> None:
        """Make `params` (any placement and dtype) the KL reference: cast to the reference dtype, on its shardings.
        A resumed run restores the reference it started with this way (`orchestration/trainer_setup.py`)."""
        if self.lora is not None:
            raise ValueError("with train.lora the KL reference is the frozen base (adapters off): nothing to set")
        dtype = self.ref_dtype
        placed = place(params, self.base_shardings)
        with jax.set_mesh(self.mesh):
            self.ref_params = jax.jit(lambda p: params_lib.cast(p, dtype), out_shardings=self.ref_shardings)(placed)

    def abstract_reference(self) -> Params:
        """ShapeDtypeStructs of the KL reference on the param shardings: a restore target."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, self.ref_dtype, sharding=s),
                            params_lib.shapes(self.model.cfg, MASTER_DTYPE), self.base_shardings)

    def _init_opt_state(self) -> None:
        with jax.set_mesh(self.mesh):
            self.opt_state = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)(self.params)

    def state_dict(self) -> dict[str, Any]:
        """Scalars a checkpoint needs besides params and opt_state (those are saved as arrays, see `abstract_state`)."""
        rng = None if self.rng is None else np.asarray(jax.random.key_data(self.rng))
        return {"step": self.step_count, "version": self.version, "rng": rng}

    def load_state_dict(self, state: dict[str, Any], params: Params | None = None, opt_state: Any = None) -> None:
        """Restore counters and RNG, and optionally params / opt_state (placed onto the trainer shardings)."""
        self.step_count = int(state["step"])
        self.version = int(state["version"])
        self.rng = None if state.get("rng") is None else jax.random.wrap_key_data(np.asarray(state["rng"]))
        if params is not None:
            self.params = place(params, self.shardings.params)
        if opt_state is not None:
            self.opt_state = place(opt_state, self.shardings.opt_state)
        elif params is not None:
            self._init_opt_state()

    def abstract_state(self) -> dict[str, Any]:
        """ShapeDtypeStructs with shardings for params and opt_state: restore targets for a checkpointer."""
        opt = jax.eval_shape(self.tx.init, self.params_abstract)
        attach = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
        return {"params": jax.tree.map(attach, self.params_abstract, self.shardings.params),
                "opt_state": jax.tree.map(attach, opt, self.shardings.opt_state)}

    def params_for_inference(self, dtype: Any = jnp.bfloat16) -> Params:
        """A cast copy of the current params (same shardings); the master copy is untouched. With LoRA, the base
        with the adapters merged in (W + alpha/r A B)."""
        self._require_params()
        with jax.set_mesh(self.mesh):
            if self.lora is not None:
                return self._merged_fn(dtype)(self.base, self.params)
            return self._cast_fn(dtype)(self.params)

    def sync_payload(self, dtype: Any, full: bool) -> Any:
        """What a weight sync moves, in the hop chain's layout (`sharding/chain.py`): the params cast to `dtype`;
        with LoRA, the adapters ({"adapters": ..}; B alone after the first with `lora.freeze_a`), plus the base
        when `full` (a receiver's first sync), both cast to `dtype`. Receivers merge (`lora.merge`, in fp32):
        the merged weight is rounded to `dtype` anyway, and adapters in `dtype` perturb it far less than that
        rounding (their product is a small correction to W), for half the bytes of fp32 adapters in bf16."""
        self._require_params()
        with jax.set_mesh(self.mesh):
            if self.lora is None:
                return self._cast_fn(dtype, self._sync_shardings["params"])(self.params)
            synced = lora_lib.synced(self.params, full, self.lora.freeze_a)
            out = {"adapters": self._cast_fn(dtype, self._sync_shardings[full])(synced)}
            if full:
                out["base"] = self._cast_fn(dtype, self._sync_shardings["params"])(self.base)
        return out

    def _merged_fn(self, dtype: Any) -> Any:
        dtype = jnp.dtype(dtype)
        if ("merged", dtype) not in self._cast_fns:
            scale = self.lora.scale
            self._cast_fns[("merged", dtype)] = jax.jit(
                lambda b, a: params_lib.cast(lora_lib.merge(b, a, scale), dtype), out_shardings=self.base_shardings)
        return self._cast_fns[("merged", dtype)]

    def _cast_fn(self, dtype: Any, shardings: Any = None) -> Any:
        """One jitted cast per dtype (and tree: the model's params, or LoRA's adapters), kept: a fresh
        `jax.jit(lambda ..)` per call would retrace and recompile on every weight sync."""
        dtype, shardings = jnp.dtype(dtype), shardings or self.base_shardings
        key = (dtype, id(shardings))
        if key not in self._cast_fns:
            self._cast_fns[key] = jax.jit(lambda p: params_lib.cast(p, dtype), out_shardings=shardings)
        return self._cast_fns[key]

    # ---- ahead-of-time compilation -------------------------------------------------------------------------
    # The programs a run executes, lowered from abstract values only (`launch.py aot` compiles them for a slice).

    def abstract_batch(self, seq_len: int) -> RLBatch:
        """The global [train_batch_size, seq_len] batch the step sees, on its shardings."""
        c = self.model.cfg
        routes = (len(c.sparse_layers), c.num_experts_per_tok, moe_lib.route_dtype(c)) if self.replay else None
        return RLBatch.abstract(self.train_cfg.train_batch_size, seq_len, self.shardings.batch, routes)

    def lower_step(self, batch: RLBatch) -> jax.stages.Lowered:
        """The train step (grad accumulation, optimizer update; params and opt_state donated) on `batch`, an
        abstract global batch such as `abstract_batch(T)`."""
        state = self.abstract_state()
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.shardings.replicated)
        ref = base = None
        model_abstract = params_lib.shapes(self.model.cfg, MASTER_DTYPE)
        frozen = lambda sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, self.ref_dtype, sharding=s),  # noqa: E731
                                         model_abstract, sh)
        if self.lora is not None:
            base = frozen(self.base_shardings)
        elif self.loss_cfg.kl_coef > 0:
            ref = frozen(self.ref_shardings)
        with jax.set_mesh(self.mesh):
            return self._step_fn.lower(state["params"], state["opt_state"], batch, step, ref, base)

    def lower_sync_cast(self, dtype: Any) -> jax.stages.Lowered:
        """What precedes every weight sync: `sync_payload`'s cast into the hop chain's layout, split over the
        trainer chips (the chain's first slot). The optimizer state stays resident meanwhile, so it rides along as
        a donated pass-through: the compiled peak then counts everything the trainer chips hold during a sync."""
        state = self.abstract_state()
        dtype = jnp.dtype(dtype)
        if self.lora is not None:  # the adapters alone travel (B alone with A frozen); the base stays resident
            base = self.abstract_reference()
            fn = jax.jit(lambda p, o, b: (params_lib.cast(lora_lib.synced(p, False, self.lora.freeze_a), dtype), o, b),
                         donate_argnums=(1, 2),
                         out_shardings=(self._sync_shardings[False], self.shardings.opt_state, self.base_shardings))
            with jax.set_mesh(self.mesh):
                return fn.lower(state["params"], state["opt_state"], base)
        fn = jax.jit(lambda p, o: (params_lib.cast(p, dtype), o), donate_argnums=(1,),
                     out_shardings=(self._sync_shardings["params"], self.shardings.opt_state))
        with jax.set_mesh(self.mesh):
            return fn.lower(state["params"], state["opt_state"])

    # ---- training -------------------------------------------------------------------------------------------

    def step(self, local_batch: RLBatch, host_metrics: HostMetrics | None = None) -> dict[str, float]:
        """One step (train.updates_per_step optimizer updates) on this host's share of the batch; every trainer
        host calls it together.

        `host_metrics` (e.g. from `collect_rollouts`) are combined across hosts and merged into the result."""
        self._require_params()
        t0 = time.perf_counter()
        rows = local_batch.tokens.shape[0] * len(self.hosts)
        if rows != self.train_cfg.train_batch_size:
            raise ValueError(f"{local_batch.tokens.shape[0]} local rows x {len(self.hosts)} trainer hosts = {rows} "
                             f"sequences, but train.train_batch_size={self.train_cfg.train_batch_size}")
        if self.replay and local_batch.expert_ids is None:
            raise ValueError("train.moe.router_replay=true, but the batch carries no expert ids: its samplers did not "
                             "record them (inference hosts started with the same train.moe)")
        if not self.replay and local_batch.expert_ids is not None:
            local_batch = dataclasses.replace(local_batch, expert_ids=None)  # recorded, but replay is off here
        local_batch = self._agree_across_hosts(local_batch)
        with jax.set_mesh(self.mesh):
            global_batch = shard_batch(local_batch, self.shardings)
            # Committed and replicated on the trainer mesh, like every other input (an uncommitted scalar would be
            # placed on the default device, which need not be one of the mesh's).
            update = self.step_count * self.train_cfg.updates_per_step
            step = jax.device_put(np.int32(update), self.shardings.replicated)
            self.params, self.opt_state, metrics = self._step_fn(self.params, self.opt_state, global_batch, step,
                                                                 self.ref_params, self.base)
        # Replicated scalars: this host's copy is the global value (a multi-host array is not fully addressable).
        # One device-to-host transfer for all of them.
        host = jax.device_get({k: v.addressable_data(0) for k, v in metrics.items()})
        self.group_weights = np.asarray(host.pop("group_weights"))
        out = {f"train/{k}": float(v) for k, v in host.items()}
        self.step_count += 1
        self.version += 1
        out["train/step_time_s"] = time.perf_counter() - t0
        if host_metrics:
            out |= self._combine_host_metrics(host_metrics)
        return out

    def _agree_across_hosts(self, batch: RLBatch) -> RLBatch:
        """Make group ids unique per host and pad every host to the same T (one tiny collective per step)."""
        if len(self.hosts) == 1:
            return batch
        B = batch.tokens.shape[0]
        offset = self.hosts.index(jax.process_index()) * B
        batch = dataclasses.replace(batch, group_ids=offset_group_ids(batch.group_ids, offset))
        lengths = host_allgather(np.asarray([batch.tokens.shape[1]]), self.mesh)
        return pad_batch(batch, int(lengths.max()))

    def group_offset(self, local_rows: int) -> int:
        """The global id of this host's first group: `_agree_across_hosts` offsets each host's ids by its rows."""
        return self.hosts.index(jax.process_index()) * local_rows if len(self.hosts) > 1 else 0

    def combine_host_metrics(self, metrics: HostMetrics) -> HostMetrics:
        """Every trainer host's `metrics` (same keys) combined by suffix (`batch.combine_host_metrics`); every host
        calls it together."""
        return self._combine_host_metrics(metrics)

    def _combine_host_metrics(self, metrics: HostMetrics) -> HostMetrics:
        if len(self.hosts) == 1:
            return dict(metrics)
        keys = sorted(metrics)
        rows = host_allgather(np.asarray([metrics[k] for k in keys]), self.mesh)  # [n_hosts, k]
        return combine_host_metrics([dict(zip(keys, map(float, row))) for row in rows])

    def _require_params(self) -> None:
        if self.params is None:
            raise RuntimeError("Trainer has no params: call init(key) or load(params) first")

    def compiled_step_count(self) -> int:
        """Number of compiled train-step programs (stays bounded: one per padded length T)."""
        return self._step_fn._cache_size()
