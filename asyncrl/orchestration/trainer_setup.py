"""Building a trainer host's `Trainer`: the model, its starting weights (random, a checkpoint folder or a model
source), the cached format warm-start, a resume from the run's latest checkpoint, and the KL reference.

The KL reference (`loss.kl_coef > 0`) is the policy the run started from: the params after any format warm-start.
It is durable state of the run, not of a step: saved once, beside the checkpoints (`run_dir/reference`, Orbax,
atomic), and restored on every resume, a restart after a kill included. A run directory without it (checkpoints
written before it was kept) rebuilds it instead: the same starting weights, the same warm-start (cached on disk).
Either way `train/kl` goes on across a resume without a jump. (With LoRA the reference is the base with the
adapters off, and there is nothing to keep.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from asyncrl.envs import build_sources, combine
from asyncrl.orchestration.checkpoint import TrainerCheckpoints, has_checkpoint, open_checkpoints, resume_latest
from asyncrl.orchestration.role_config import TrainerRoleConfig
from asyncrl.sharding.roles import split_roles

log = logging.getLogger(__name__)

REFERENCE_DIR = "reference"


def build_trainer(cfg: TrainerRoleConfig, run_dir: str) -> tuple[Any, TrainerCheckpoints | None, dict[str, Any]]:
    """(trainer, the run's checkpoints or None, the resumed checkpoint's meta or {})."""
    from asyncrl.models.sources import load_model, model_config
    from asyncrl.models.transformer import Model
    from asyncrl.train.trainer import Trainer

    roles = split_roles(jax.devices(), cfg.async_.train_workers)
    model = Model(model_config(cfg.model), logits_precision=cfg.model.logits_precision)
    trainer = Trainer(model, cfg.train, cfg.loss, cfg.sharding, devices=roles.trainer_devices,
                      temperature=cfg.temperature)
    key = jax.random.PRNGKey(cfg.seed)
    if cfg.model.path or cfg.model.source:
        _, params = load_model(cfg.model, key)
        trainer.rng = jax.random.key(cfg.seed)  # first: LoRA's adapters are drawn from it by `load`
        trainer.load(params)
    else:
        trainer.init(key)
    resuming = cfg.checkpoint.resume and has_checkpoint(run_dir)
    reference = _reference_store(cfg, run_dir)
    kept = reference is not None and reference.latest_step() is not None
    # The warm-start makes the starting policy. A resume skips it (the checkpoint holds the policy), unless the KL
    # reference must be rebuilt from it, or the run trains LoRA adapters: their base is the warm-started model.
    lora = cfg.train.lora.enabled
    if cfg.train.format_warmstart_steps and (lora or not resuming or (cfg.loss.kl_coef > 0 and not kept)):
        warmstart(cfg, trainer, model, run_dir)
    if reference is not None:
        if kept:
            state, _ = reference.restore(0, {"params": trainer.abstract_reference()})
            trainer.set_reference(state["params"])
        else:
            if resuming:
                log.warning("the run directory has no saved KL reference (%s): rebuilt it from the starting weights "
                            "and the cached warm-start", os.path.join(run_dir, REFERENCE_DIR))
            reference.save_tree(0, {"params": trainer.ref_params}, {"kind": "start"})
        reference.close()
    ckpt = open_checkpoints(cfg.checkpoint, cfg.async_.train_workers, run_dir)
    meta = resume_latest(ckpt, trainer) if (ckpt is not None and cfg.checkpoint.resume) else {}
    return trainer, ckpt, meta


def _reference_store(cfg: TrainerRoleConfig, run_dir: str) -> TrainerCheckpoints | None:
    """Where the KL reference is kept: only with the KL term on and checkpoints saved or resumed. Not with LoRA: the
    reference is the frozen base, which every start rebuilds from its source (and the cached warm-start)."""
    if cfg.loss.kl_coef == 0 or cfg.train.lora.enabled or not (cfg.checkpoint.every_n_steps or cfg.checkpoint.resume):
        return None
    return TrainerCheckpoints(os.path.join(run_dir, REFERENCE_DIR), 1, cfg.async_.train_workers)


def warmstart(cfg: TrainerRoleConfig, trainer: Any, model: Any, run_dir: str) -> None:
    """Format warm-start SFT (`train.format_warmstart_steps`), cached on disk; keeps the trainer's RNG."""
    from asyncrl.models.sources import cache_dir, load_tokenizer
    from asyncrl.train.warmstart import cached_format_warmstart

    # Every trainer host computes the same thing (same seed, same data), so no broadcast is needed.
    sources = build_sources(cfg.task)
    task, tokenizer, key = combine(sources, cfg.task), load_tokenizer(cfg.model, run_dir), cfg.task
    tool_labels = {s.task.label for s in sources if s.tools}
    if tool_labels:  # examples in the tool episodes' own layout
        from asyncrl.envs.tool_use import Toolbox, ToolWarmstart

        task = ToolWarmstart(task, Toolbox(cfg.tools, tokenizer, cfg.task.prompt_template == "chat"), tool_labels)
        key = (cfg.task, cfg.tools, ToolWarmstart.LAYOUT)
    params = cached_format_warmstart(
        model, trainer.params_for_inference(jnp.float32), tokenizer,
        task, key, cfg.train.format_warmstart_steps, cache_dir(), cfg.seed,
        chat=cfg.task.prompt_template == "chat", lr=cfg.train.format_warmstart_lr,
        batch=cfg.train.format_warmstart_batch, source=repr(cfg.model))
    rng = trainer.rng
    trainer.load(params)
    trainer.rng = rng
