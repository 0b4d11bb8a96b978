"""Trainer, optimizer and sharding configs (the blog's MeshConfig / ShardingConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.validate import check, check_choice


@dataclass(frozen=True)
class MeshConfig:
    """Training mesh axes. -1 means "all remaining devices"; at most one axis may be -1."""

    dp: int = 1
    """Pure data parallel replicas (params replicated across dp)."""
    fsdp: int = -1
    """Fully sharded data parallel: params and optimizer state are split over this axis; the batch too."""
    expert: int = 1
    """Expert parallel devices: a mixture-of-experts layer's experts are split over them (each holds E / expert
    experts, whole along their width; FSDP still splits them along D). Outside the MoE layers this axis is one more
    data axis (the batch splits over dp x fsdp x expert); inside one, each device gathers its expert group's tokens,
    runs the ones routed to its own experts, and the outputs are summed back onto their tokens' devices
    (`models/moe.py`). Must divide the model's num_experts. 1 turns it off."""
    cp_ulysses: int = 1
    """Context (sequence) parallel devices, Ulysses style: training activations are split over the sequence, and
    an all-to-all around attention re-splits them over heads. Cuts activation memory per device, not param or
    optimizer memory (those are replicated over cp). The model's num_heads and train.pad_to_multiple must be
    multiples of it, and one cp group must not span hosts. 1 turns it off."""

    def __post_init__(self) -> None:
        for k in ("dp", "fsdp", "expert", "cp_ulysses"):
            v = getattr(self, k)
            check(f"sharding.mesh.{k}", v, v == -1 or v >= 1, ">= 1 or -1 (the rest)")
        axes = (self.dp, self.fsdp, self.expert, self.cp_ulysses)
        check("sharding.mesh", axes, list(axes).count(-1) <= 1, "at most one axis set to -1")

    def resolve(self, n_devices: int) -> tuple[int, int, int, int]:
        """(dp, fsdp, expert, cp) sizes over `n_devices`: the mesh's shape in `sharding.axes.MESH_AXES` order."""
        sizes = [self.dp, self.fsdp, self.expert, self.cp_ulysses]
        known = 1
        for s in sizes:
            if s != -1:
                known *= s
        if n_devices % known != 0:
            raise ValueError(f"sharding.mesh={sizes} does not divide {n_devices} devices")
        sizes = [n_devices // known if s == -1 else s for s in sizes]
        used = sizes[0] * sizes[1] * sizes[2] * sizes[3]
        if used != n_devices:
            raise ValueError(f"sharding.mesh={sizes} uses {used} devices, but {n_devices} are given")
        return sizes[0], sizes[1], sizes[2], sizes[3]


@dataclass(frozen=True)
class ShardingConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Axis sizes of the trainer mesh."""
    min_bytes_for_fsdp: int = 10_000_000
    """Params smaller than this (or 1-D) are replicated: sharding them only adds collective latency."""
    fsdp_axis: str = "embed"
    """Logical axis (dimension) along which a weight is sharded over fsdp: embed, vocab, mlp, heads, layers."""
    opt_state_offload: bool = False
    """Keep optimizer state in pinned host memory between steps (TPU/GPU only; ignored on CPU)."""

    def __post_init__(self) -> None:
        check("sharding.min_bytes_for_fsdp", self.min_bytes_for_fsdp, self.min_bytes_for_fsdp >= 0, ">= 0")
        check_choice("sharding.fsdp_axis", self.fsdp_axis, ("embed", "vocab", "mlp", "heads", "layers"))


# models/lora.py's TARGETS, by name: this module is loaded before jax is (tests/test_lora_train.py checks they agree).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (models/lora.py): the base model frozen in the compute dtype with no optimizer state, only
    the adapters trained (fp32, the run's optimizer), synced and checkpointed. rank 0 is the full fine-tune."""

    rank: int = 0
    """Adapter rank r; 0 trains every weight (no adapters)."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Which projections get adapters: any of q, k, v, o, gate, up, down."""
    freeze_a: bool = False
    """LoRA-FA: A stays at its random init and only B trains (no gradient or optimizer state for A), so each
    weight sync after the first moves B alone: about half the bytes (Qwen3-8B, rank 32, all targets: 183x fewer
    than a full sync instead of 94x)."""

    def __post_init__(self) -> None:
        check("train.lora.rank", self.rank, self.rank >= 0, ">= 0")
        check("train.lora.alpha", self.alpha, self.alpha > 0, "> 0")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        check("train.lora.targets", list(self.targets),
              not bad and len(self.targets) > 0 and len(set(self.targets)) == len(self.targets),
              f"a non-empty list of distinct names from {list(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts training options (`train.moe`); a dense model ignores them."""

    router_replay: bool = False
    """Router replay (R3): the sampler records the top-k expert ids of every sampled token at every MoE layer, kept
    with the completion like its logprobs, and the trainer's forward passes (the proximal and the policy pass) route
    those tokens to those experts, with the gate weights recomputed from the current router (so it still learns).
    Prompt and observation tokens take the router's own choice. Costs L_moe x k bytes a token (int8 ids; int16
    past 128 experts) in the rollout, the queues and the batch."""
    aux_coef: float = 0.0
    """Weight of the Switch / Qwen3-MoE load-balancing loss (transformers' `load_balancing_loss_func`: num_experts x
    sum_e f_e P_e over every MoE layer's valid tokens) added to the loss; the step then logs it (`moe_aux_loss`)
    and the experts' load (`moe_load_max`, `moe_load_min`: the busiest and idlest expert's share of assignments).
    0 turns it off."""

    def __post_init__(self) -> None:
        check("train.moe.aux_coef", self.aux_coef, self.aux_coef >= 0, ">= 0")


@dataclass(frozen=True)
class TrainConfig:
    total_steps: int = 100
    """Optimizer steps to run."""
    train_batch_size: int = 64
    """Sequences per step across all trainer hosts (= prompts per step x group_size)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer update; the (mini-)batch is split evenly and gradients summed (normalised over
    the whole (mini-)batch)."""
    updates_per_step: int = 1
    """Optimizer updates per rollout batch (PPO epochs x mini-batches, one pass): the batch is split into this many
    mini-batches, each one update. Before the first, the step computes the proximal logprobs of the whole batch
    under the current params, and every update clips pi / pi_prox against them (decoupled PPO); the sampler gap is
    then left to the rollout correction (loss.is_mode). 1 is the single-update step, where the sampler's logprobs
    (or, with a correction, the current params) are the proximal policy. The lr schedule counts updates:
    total_steps x updates_per_step of them, warmup_steps x updates_per_step of warm-up."""
    ref_offload: bool = False
    """With loss.kl_coef > 0: keep the reference params (the initial policy) in pinned host memory rather than on
    the trainer chips; the step copies them in to compute the reference logprobs."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    max_grad_norm: float = 1.0
    """Global-norm gradient clipping threshold (0 disables)."""
    logprob_chunk_size: int = 1024
    """Tokens per chip per chunk of the fused LM-head logprob scan: bounds each chip's [chunk, V] fp32 temporary.
    Each chunk re-reads the whole gathered LM head, so larger chunks mean less HBM traffic."""
    compute_dtype: str = "float32"
    """Dtype of the forward and backward matmuls. Master params and optimizer state stay fp32 either way (cast on
    their FSDP shards, so the weight all-gathers move this dtype too); 'bfloat16' is the TPU choice, float32 the
    CPU one (XLA:CPU has no fast bf16 matmul). Norms, softmax and the LM head's log-softmax run in fp32."""
    remat: bool = False
    """Recompute each layer's activations in the backward pass (activation checkpointing): memory for one
    layer's activations instead of all of them, for ~1/3 more compute. Needed for long sequences and big models."""
    remat_policy: str = "full"
    """What `remat` keeps per layer: 'full' only the residual stream (least memory, the whole forward is
    recomputed); 'dots' also every matmul output (norms, activations and attention are recomputed, the matmuls
    are not: ~25% fewer FLOPs for some GB of activations)."""
    attention: str = "auto"
    """Training attention: 'auto' uses the Pallas flash kernel (models/flash.py) on TPU meshes, where the
    sequence divides into its tiles, cuDNN's fused attention on GPUs where dtype and head dim allow it
    (models/attention_impl.py), and the reference elsewhere; 'reference' is the plain masked softmax
    (materialises [T, T] scores); 'flash' forces the kernel (off TPU it runs only under Pallas interpret mode)."""
    pad_to_multiple: int = 16
    """Train sequences are padded to a multiple of this (bounded set of compiled shapes)."""
    format_warmstart_steps: int = 0
    """Before RL, this many SFT steps on prompts paired with *shuffled* gold answers: teaches the answer format
    and stopping, not the task (see asyncrl/train/warmstart.py). For models trained from scratch, or a small
    instruct model that ignores the format; cached."""
    format_warmstart_lr: float = 3e-3
    """Adam learning rate of the warm-start (3e-3 suits a random-init tiny model; ~1e-5 a pretrained one)."""
    format_warmstart_batch: int = 64
    """Sequences per warm-start step."""
    ess_scaled_lr: bool = False
    """Scale each optimizer update (the learning rate, weight decay included) by the Kish effective sample size,
    as a fraction, of its batch's importance weights pi_prox / pi_sampler (VCPO, arXiv 2602.17616): stale batches,
    whose weights a few tokens dominate, take smaller steps. `train/ess_lr_scale` logs the factor. False: the
    update is untouched."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters on a frozen base (rank 0, the default, is the full fine-tune)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts options: router replay and the load-balancing loss."""

    def __post_init__(self) -> None:
        check("train.total_steps", self.total_steps, self.total_steps >= 1, ">= 1")
        check("train.train_batch_size", self.train_batch_size, self.train_batch_size >= 1, ">= 1")
        check("train.grad_accum_steps", self.grad_accum_steps,
              self.grad_accum_steps >= 1 and self.train_batch_size % self.grad_accum_steps == 0,
              f">= 1 and divide train.train_batch_size={self.train_batch_size}")
        k = self.updates_per_step
        check("train.updates_per_step", k, k >= 1 and self.train_batch_size % (k * self.grad_accum_steps) == 0,
              f">= 1 and, times train.grad_accum_steps={self.grad_accum_steps}, divide "
              f"train.train_batch_size={self.train_batch_size}")
        check("train.lr", self.lr, self.lr > 0, "> 0")
        check("train.min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]")
        check("train.warmup_steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0")
        check("train.weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0")
        check("train.b1", self.b1, 0 <= self.b1 < 1, "in [0, 1)")
        check("train.b2", self.b2, 0 <= self.b2 < 1, "in [0, 1)")
        check("train.max_grad_norm", self.max_grad_norm, self.max_grad_norm >= 0, ">= 0")
        check("train.logprob_chunk_size", self.logprob_chunk_size, self.logprob_chunk_size >= 1, ">= 1")
        check("train.pad_to_multiple", self.pad_to_multiple, self.pad_to_multiple >= 1, ">= 1")
        check_choice("train.compute_dtype", self.compute_dtype, ("float32", "bfloat16"))
        check_choice("train.remat_policy", self.remat_policy, ("full", "dots"))
        check_choice("train.attention", self.attention, ("auto", "reference", "flash"))
        check("train.format_warmstart_steps", self.format_warmstart_steps, self.format_warmstart_steps >= 0, ">= 0")
        check("train.format_warmstart_lr", self.format_warmstart_lr, self.format_warmstart_lr > 0, "> 0")
        check("train.format_warmstart_batch", self.format_warmstart_batch, self.format_warmstart_batch >= 1, ">= 1")
