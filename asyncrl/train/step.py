"""One jitted train step: full-batch loss inputs, then `train.updates_per_step` optimizer updates, each with
gradient accumulation over micro-batches.

The step sees the *global* batch (sharded over the data axes, and along T over "cp" under context parallelism,
see `train/mesh.py`), so everything it reduces is global:
1. Advantages (and, with one update, token weights) are computed over the whole batch before it is split, and
   only here: the host batch carries rewards and masks (advantages.py explains why the sum of micro-batch losses
   then equals the full-batch loss).
2. Logprobs that must not move during the step are computed first, with no gradient: the KL reference's
   (loss.kl_coef > 0) and, with several updates, the proximal policy's (the params before the first update:
   decoupled PPO, AReaL), so that every update clips pi / pi_prox against the same policy.
3. With k = updates_per_step, the batch is cut into k mini-batches and a `lax.scan` takes one optimizer update on
   each; each mini-batch's token weights are normalised over itself. Within an update, the mini-batch is cut into
   `grad_accum_steps` micro-batches `[G, B/G, ...]` and a `lax.scan` sums loss, grads and metrics. Slices are
   strided (micro-batch g takes rows g, G+g, 2G+g, ...) so that each device's rows stay on that device.
4. The summed grads go through clipping + AdamW once per update.

Params and optimizer state are donated and come back on their pinned shardings, so a step never holds two
copies of either. Trainer logprobs use the fused chunked LM head (`fused_logprobs_and_entropy`): the [N, V]
logits are never materialised, and entropy comes from the same scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from asyncrl.models import lora as lora_lib, moe as moe_lib, params as params_lib
from asyncrl.models.params import Params
from asyncrl.models.transformer import Model
from asyncrl.ops.logprobs import LOGITS_PRECISIONS, fused_logprobs_and_entropy, scale_for_temperature
from asyncrl.sharding.axes import DATA_AXES
from asyncrl.train.advantages import check_normalizer, keep_sequences, loss_weights, prepare_loss_inputs
from asyncrl.train.batch import RLBatch
from asyncrl.train.config import LoraConfig, MoeConfig
from asyncrl.train.ess import batch_ess, group_weight_sums
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.losses import Metrics, finalize_metrics, metric_reduction
from asyncrl.train.mesh import TrainShardings
from asyncrl.train.optimizer import Schedule
from asyncrl.train.registry import get_loss, validate

StepFn = Callable[[Params, Any, RLBatch, jax.Array], tuple[Params, Any, Metrics]]


def _explicit() -> bool:
    m = jax.sharding.get_abstract_mesh()
    return not m.empty and bool(m.explicit_axes)


def _reshard(x: jax.Array, spec: P) -> jax.Array:
    return jax.sharding.reshard(x, spec) if _explicit() else x


def _data_spec(ndim: int, lead: int = 0) -> P:
    """Batch dim (after `lead` leading dims) over the data axes that the ambient mesh has."""
    m = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in DATA_AXES if a in m.axis_names) or None
    return P(*([None] * lead), axes, *([None] * (ndim - lead - 1)))


def token_logprobs(model: Model, params: Params, tokens: jax.Array, seq_lens: jax.Array, temperature: float,
                   chunk_size: int, expert_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] -> (logprob of tokens[:, 1:], entropy of that prediction), each [B, T-1] fp32.

    Unlike `Model.get_logprobs`, positions past seq_lens - 1 are not zeroed: the loss mask handles them. Every
    one of the T positions is scored against its next token (the last against a dummy, then dropped), so that
    the sequence dim of the activations stays T and still divides over a context-parallel axis. `expert_ids`
    [B, T, Lm, k]: the sampler's routing to replay (train.moe.router_replay; -1: the router's own choice)."""
    return _logprobs_and_load(model, params, tokens, seq_lens, temperature, chunk_size, expert_ids)[:2]


def _logprobs_and_load(model: Model, params: Params, tokens: jax.Array, seq_lens: jax.Array, temperature: float,
                       chunk_size: int, expert_ids: jax.Array | None = None, load: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`token_logprobs`, and with `load` the MoE layers' load sums over the valid tokens ([Lm, 2, E], for the
    load-balancing loss: `moe.load_sums`)."""
    sums = None
    if expert_ids is None and not load:  # a dense model, or MoE without replay or aux loss: the plain forward
        h, _ = model.apply(params, tokens, seq_lens, apply_lm_head=False)  # [B, T, D]
    else:
        mask = jnp.arange(tokens.shape[1])[None, :] < seq_lens[:, None] if load else None  # [B, T]
        h, _, routed = model.apply_routed(params, tokens, seq_lens, apply_lm_head=False, expert_ids=expert_ids,
                                          load_mask=mask)
        sums = routed[1] if load else None
    h = scale_for_temperature(h, temperature)
    lp, ent = fused_logprobs_and_entropy(model.flatten_positions(h), model.lm_head_weight(params),
                                         model.flatten_positions(model.next_token_targets(tokens)),
                                         chunk_size, LOGITS_PRECISIONS[model.logits_precision])  # [B*T]
    B = tokens.shape[0]
    return model.drop_last_position(lp, B), model.drop_last_position(ent, B), sums


def split_micro_batches(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...]; micro-batch g holds rows g, n+g, 2n+g, ... (no cross-device movement)."""
    B, rest = x.shape[0], x.shape[1:]
    if _explicit():
        # Trailing dims keep their layout: the sequence dim of [B, T] leaves may be split over "cp".
        spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
        x = jnp.reshape(x, (B // n, n, *rest), out_sharding=P(_data_spec(1)[0], None, *spec[1:x.ndim]))
        return jnp.swapaxes(x, 0, 1)
    return jnp.swapaxes(x.reshape(B // n, n, *rest), 0, 1)


def _reduce_stacked(metrics: Metrics) -> Metrics:
    """Per-micro-batch metrics stacked on axis 0 -> one value each, by the suffix rule of losses.py."""
    ops = {"sum": jnp.sum, "min": jnp.min, "max": jnp.max}
    return {k: ops[metric_reduction(k)](v, axis=0) for k, v in metrics.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossBatch(RLBatch):
    """An RLBatch and the two things the loss reads besides it, computed once, in the step, over the global batch
    (group statistics and token normalisers count every host's rows)."""

    advantages: jax.Array  # [B] float32
    weights: jax.Array  # [B, T] float32, per-token loss weights normalised over the batch (or the mini-batch)


def with_loss_inputs(batch: RLBatch, loss_cfg: LossConfig) -> LossBatch:
    """The batch with its advantages and loss weights (`advantages.prepare_loss_inputs`)."""
    # The [B, B] group comparison would put the data axes on both of its dims; these few [B] / [B, T] arrays
    # are small, so they are gathered, computed whole, and split again.
    whole = lambda x: _reshard(x, P(*([None] * x.ndim)))  # noqa: E731
    adv, weights = prepare_loss_inputs(whole(batch.rewards), whole(batch.group_ids), whole(batch.loss_mask), loss_cfg)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(RLBatch)}
    return LossBatch(**fields, advantages=_reshard(adv, _data_spec(1)), weights=_reshard(weights, _data_spec(2)))


def make_loss_fn(model: Model, loss_cfg: LossConfig, temperature: float, chunk_size: int,
                 compute_dtype: Any = None, n_groups: int | None = None, moe: MoeConfig | None = None,
                 micro_batches: int = 1) -> Callable[..., tuple[jax.Array, Metrics]]:
    """The micro-batch loss `(params, mb, frozen={}) -> (loss, metrics)`. `frozen` holds detached [b, T-1]
    logprobs of the same rows: "prox" (the proximal policy) and "ref" (the KL reference), when the step has them.
    With `compute_dtype`, the (fp32 master) params are cast first: on their FSDP shards, so each layer's
    all-gather and matmuls run in that dtype, and the gradient comes back through the cast in the master dtype.
    With `n_groups` (the batch's group ids are below it), the metrics also hold "group_weights" [n_groups, 4], the
    importance-weight sums of each group (`train/ess.py`), summed like any other metric. With `moe.aux_coef` > 0
    (a MoE model), the load-balancing loss of the micro-batch, over `micro_batches` (so that the micro-batches of an
    update add up to their mean), is added, and logged with the experts' load (`moe_aux_loss`, `moe_load_max`,
    `moe_load_min`). A batch's `expert_ids` (train.moe.router_replay) route its tokens."""
    loss_fn = get_loss(loss_cfg.name)
    aux_coef = moe.aux_coef if moe is not None and model.cfg.is_moe else 0.0

    def micro_loss(params: Params, mb: LossBatch, frozen: dict[str, jax.Array] | None = None
                   ) -> tuple[jax.Array, Metrics]:
        frozen = frozen or {}
        if compute_dtype is not None:
            params = params_lib.cast(params, compute_dtype)
        with jax.named_scope("logprobs"):
            lp, ent, sums = _logprobs_and_load(model, params, mb.tokens, mb.seq_lens, temperature, chunk_size,
                                               mb.expert_ids, aux_coef > 0)  # [b, T-1]
        # [b, T] fields may be split over "cp"; explicit sharding cannot slice such a dim to T-1, so these small
        # arrays take the batch-only layout of `lp` first.
        from_second = lambda x: _reshard(x, _data_spec(2))[:, 1:]  # noqa: E731
        mask = from_second(mb.loss_mask)
        with jax.named_scope("loss"):
            loss, metrics = loss_fn(lp, from_second(mb.sampler_logprobs), mb.advantages, from_second(mb.weights),
                                    mask, loss_cfg, frozen.get("ref"), prox_logprobs=frozen.get("prox"))
        metrics = dict(metrics)
        if aux_coef > 0:
            aux, load = moe_lib.load_balancing_loss(sums, jnp.sum(mb.seq_lens).astype(jnp.float32),
                                                    model.cfg.num_experts_per_tok)
            loss = loss + aux_coef * aux / micro_batches
            metrics |= {"moe_aux_loss": aux / micro_batches, "moe_load_max": jnp.max(load),
                        "moe_load_min": jnp.min(load)}
        metrics["entropy_sum"] = jnp.sum(jnp.where(mask, ent, 0.0))
        metrics["tokens"] = jnp.sum(mb.seq_lens).astype(jnp.float32)
        if n_groups is not None:
            # The proximal policy; with one update per step it is the params the loss runs (lp, detached).
            lp_prox = frozen.get("prox", lp)
            metrics["group_weights"] = group_weight_sums(lp_prox, from_second(mb.sampler_logprobs), mask,
                                                         mb.group_ids, n_groups)
        return loss, metrics

    return micro_loss


def frozen_logprobs(model: Model, params: Params, batch: RLBatch, updates: int, grad_accum_steps: int,
                    temperature: float, chunk_size: int, compute_dtype: Any = None) -> jax.Array:
    """Detached logprobs of every row under `params` (the proximal or the reference policy), laid out as the
    updates consume them: [updates, grad_accum_steps, b, T-1], entry [j, g] for micro-batch g of mini-batch j.

    The same fused chunked LM head as the loss, one micro-batch at a time (the memory of a forward pass without
    its backward), and no gradient."""
    if compute_dtype is not None:
        params = params_lib.cast(params, compute_dtype)

    def micro(_, mb: tuple[jax.Array, ...]) -> tuple[None, jax.Array]:
        lp, _ = token_logprobs(model, params, mb[0], mb[1], temperature, chunk_size, *mb[2:])
        return None, jax.lax.stop_gradient(lp)

    def mini(_, x: tuple[jax.Array, ...]) -> tuple[None, jax.Array]:
        return jax.lax.scan(micro, None, tuple(split_micro_batches(a, grad_accum_steps) for a in x))

    split = lambda a: split_micro_batches(a, updates)  # noqa: E731
    routes = () if batch.expert_ids is None else (split(batch.expert_ids),)  # train.moe.router_replay
    return jax.lax.scan(mini, None, (split(batch.tokens), split(batch.seq_lens), *routes))[1]


def _accumulate_and_update(grad_fn: Callable, tx: optax.GradientTransformation, grad_accum_steps: int,
                           params: Params, opt_state: Any, mini: LossBatch, frozen: dict[str, jax.Array],
                           opt_state_compute: Any = None, ess_scaled: bool = False
                           ) -> tuple[Params, Any, Metrics, Params, Params]:
    """One optimizer update on one mini-batch: grads summed over its micro-batches, then clipping + AdamW.
    With `ess_scaled` (train.ess_scaled_lr), the update is multiplied by the Kish ESS of the mini-batch's importance
    weights: the learning rate times ESS, weight decay included, as VCPO scales its step. Returns (params,
    opt_state, reduced metrics, grads, updates)."""
    micro = jax.tree.map(lambda x: split_micro_batches(x, grad_accum_steps), mini)

    def body(acc: Params, xs: tuple[LossBatch, dict[str, jax.Array]]) -> tuple[Params, Metrics]:
        (_, metrics), g = grad_fn(params, *xs)
        return jax.tree.map(jnp.add, acc, g), metrics

    with jax.named_scope("grad_accum"):
        # One path for every grad_accum_steps: at 1 the scan carry costs no extra buffer (measured on SmolLM2).
        grads, stacked = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (micro, frozen))
        metrics = _reduce_stacked(stacked)
    with jax.named_scope("optimizer"):
        if opt_state_compute is not None:
            opt_state = jax.device_put(opt_state, opt_state_compute)
        updates, opt_state = tx.update(grads, opt_state, params)
        if ess_scaled:
            # The ESS comes from this mini-batch's proximal pass (its summed group weights): known before the update.
            scale = batch_ess(metrics["group_weights"])
            updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
            metrics = metrics | {"ess_lr_scale": scale}
        params = optax.apply_updates(params, updates)
    return params, opt_state, metrics, grads, updates


# Values that are already means over an update's tokens (or norms of one update): over several updates they
# are averaged, where token sums and counts add up.
PER_UPDATE = ("loss", "pg_loss", "kl_loss", "grad_norm", "update_norm", "ess_lr_scale", "moe_aux_loss")


def _combine_updates(stacked: Metrics) -> Metrics:
    out = _reduce_stacked({k: v for k, v in stacked.items() if k not in PER_UPDATE})
    return out | {k: jnp.mean(v, axis=0) for k, v in stacked.items() if k in PER_UPDATE}


def train_step(model: Model, tx: optax.GradientTransformation, loss_cfg: LossConfig, schedule: Schedule,
               grad_accum_steps: int, temperature: float, chunk_size: int, params: Params, opt_state: Any,
               batch: RLBatch, step: jax.Array, opt_state_compute: Any = None, compute_dtype: Any = None,
               updates_per_step: int = 1, ref_params: Params | None = None, ref_compute: Any = None,
               base: Params | None = None, lora: LoraConfig | None = None, ess_scaled: bool = False,
               moe: MoeConfig | None = None) -> tuple[Params, Any, Metrics]:
    """The unjitted step (see `make_train_step`). `opt_state_compute` moves an offloaded state into device memory,
    `ref_compute` an offloaded reference. With LoRA (`base` given), `params` are the adapters: the loss runs the
    base with them attached (`lora.attach`), gradients and updates are the adapters' only (B's alone with
    `lora.freeze_a`), and the KL reference is the base itself (adapters off)."""
    k = updates_per_step
    # Group ids are below the row count (each host's ids are offset by its rows, `Trainer._agree_across_hosts`).
    micro_loss = make_loss_fn(model, loss_cfg, temperature, chunk_size, compute_dtype, batch.tokens.shape[0], moe,
                              grad_accum_steps)
    full = lambda p: p  # noqa: E731
    if base is not None:
        trained = lora_lib.with_frozen_a if lora.freeze_a else (lambda p: p)
        full = lambda p: lora_lib.attach(base, trained(p), lora.scale)  # noqa: E731
        model_loss = micro_loss
        micro_loss = lambda p, mb, frozen=None: model_loss(full(p), mb, frozen)  # noqa: E731
        ref_params = base
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    frozen_lp = lambda p: frozen_logprobs(model, p, batch, k, grad_accum_steps, temperature, chunk_size,  # noqa: E731
                                          compute_dtype)
    with jax.named_scope("loss_inputs"):
        batch = with_loss_inputs(batch, loss_cfg)
    frozen: dict[str, jax.Array] = {}  # each [k, grad_accum_steps, b, T-1]
    if loss_cfg.kl_coef > 0:
        if ref_params is None:
            raise ValueError("loss.kl_coef > 0: the step needs the reference params")
        if ref_compute is not None:
            ref_params = jax.device_put(ref_params, ref_compute)
        with jax.named_scope("ref_logprobs"):
            frozen["ref"] = frozen_lp(ref_params)
    if k > 1:
        # Decoupled PPO: the proximal policy is the params before the first update, for every mini-batch.
        with jax.named_scope("prox_logprobs"):
            frozen["prox"] = frozen_lp(full(params))

    if k == 1:
        # Exactly the single-update step (bit for bit when no frozen logprobs are needed): the weights above
        # are normalised over the whole batch, which is the one mini-batch.
        params, opt_state, metrics, grads, updates = _accumulate_and_update(
            grad_fn, tx, grad_accum_steps, params, opt_state, batch, {n: v[0] for n, v in frozen.items()},
            opt_state_compute, ess_scaled)
        metrics = finalize_metrics(metrics)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["update_norm"] = optax.global_norm(updates)
    else:
        # Advantages stay those of the whole batch (groups span mini-batches); each update's loss is normalised
        # over its own mini-batch, as in PPO's mini-batch SGD, so every update has the scale of a one-update step.
        whole = lambda x: _reshard(x, P(*([None] * x.ndim)))  # noqa: E731
        keep = _reshard(keep_sequences(whole(batch.rewards), whole(batch.group_ids), loss_cfg), _data_spec(1))
        minis = jax.tree.map(lambda x: split_micro_batches(x, k), batch)
        if opt_state_compute is not None:  # the scan carry must keep one memory kind: device memory throughout
            opt_state = jax.device_put(opt_state, opt_state_compute)

        def update(carry: tuple[Params, Any], xs: tuple[LossBatch, jax.Array, dict[str, jax.Array]]):
            mini, keep_j, frozen_j = xs
            mini = dataclasses.replace(mini, weights=loss_weights(mini.loss_mask, loss_cfg, keep_j))
            p, o, m, grads, updates = _accumulate_and_update(grad_fn, tx, grad_accum_steps, *carry, mini, frozen_j,
                                                             ess_scaled=ess_scaled)
            return (p, o), m | {"grad_norm": optax.global_norm(grads), "update_norm": optax.global_norm(updates)}

        with jax.named_scope("updates"):
            (params, opt_state), stacked = jax.lax.scan(update, (params, opt_state),
                                                        (minis, split_micro_batches(keep, k), frozen))
        metrics = finalize_metrics(_combine_updates(stacked))
    metrics["lr"] = schedule(step)
    return params, opt_state, metrics | _sample_counts(batch, loss_cfg)


def _sample_counts(batch: RLBatch, loss_cfg: LossConfig) -> Metrics:
    """How many samples of the batch were cut at the length limit, and how many DAPO's overlong penalty
    (`overlong_penalized`) and overlong filtering (`overlong_filtered`) touched."""
    count = lambda x: jnp.sum(x).astype(jnp.float32)  # noqa: E731
    truncated = count(batch.truncated)
    return {"samples_truncated": truncated, "overlong_penalized": count(batch.overlong_penalty < 0),
            "overlong_filtered": truncated if loss_cfg.overlong_filter else jnp.zeros((), jnp.float32)}


def make_train_step(model: Model, tx: optax.GradientTransformation, loss_cfg: LossConfig, schedule: Schedule,
                    shardings: TrainShardings, grad_accum_steps: int, temperature: float, chunk_size: int,
                    compute_dtype: Any = None, updates_per_step: int = 1, ref_compute: Any = None,
                    lora: LoraConfig | None = None, ess_scaled: bool = False, moe: MoeConfig | None = None) -> StepFn:
    """`step_fn(params, opt_state, global_batch, step, ref_params=None, base=None) -> (params, opt_state,
    metrics)`, jitted, params and optimizer state donated. `ref_params` (the KL reference) is needed when
    loss.kl_coef > 0; it may live in pinned host memory, in which case `ref_compute` gives its device-memory
    shardings. With LoRA, `params` are the adapters, `base` the frozen model weights (not donated; also the KL
    reference) and `lora` the train.lora config. `ess_scaled`: train.ess_scaled_lr. `moe`: train.moe.

    Must be called under `jax.set_mesh(shardings.mesh)`. `step` (int32 scalar) is the optimizer update about to
    be taken (the step's first, with several updates per step); it only feeds the `lr` metric (the optimizer
    keeps its own count)."""
    validate(loss_cfg)
    check_normalizer(loss_cfg)
    compute = shardings.opt_state_compute if shardings.offloaded else None
    fn = lambda params, opt_state, batch, step, ref_params=None, base=None: train_step(  # noqa: E731
        model, tx, loss_cfg, schedule, grad_accum_steps, temperature, chunk_size, params, opt_state, batch, step,
        compute, compute_dtype, updates_per_step, ref_params, ref_compute, base, lora, ess_scaled, moe)
    return jax.jit(fn, donate_argnums=(0, 1),
                   out_shardings=(shardings.params, shardings.opt_state, shardings.replicated))
