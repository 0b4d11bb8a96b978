"""Building a trainer host's `Trainer`: the model, its starting weights (random, a checkpoint folder or a model
source), the cached format warm-start, and a resume from the run's latest checkpoint."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from asyncrl.orchestration.checkpoint import TrainerCheckpoints, has_checkpoint, open_checkpoints, resume_latest
from asyncrl.sharding.roles import split_roles
from asyncrl.tasks import build_task


def build_trainer(cfg: Any, run_dir: str) -> tuple[Any, TrainerCheckpoints | None, dict[str, Any]]:
    """(trainer, the run's checkpoints or None, the resumed checkpoint's meta or {})."""
    from asyncrl.models.sources import load_model, model_config
    from asyncrl.models.transformer import Model
    from asyncrl.train.trainer import Trainer

    roles = split_roles(jax.devices(), cfg.async_.train_workers)
    model = Model(model_config(cfg.model))
    trainer = Trainer(model, cfg.train, cfg.loss, cfg.sharding, devices=roles.trainer_devices,
                      temperature=cfg.inference.temperature)
    key = jax.random.PRNGKey(cfg.run.seed)
    if cfg.model.path or cfg.model.source:
        _, params = load_model(cfg.model, key)
        trainer.load(params)
        trainer.rng = jax.random.key(cfg.run.seed)
    else:
        trainer.init(key)
    resuming = cfg.checkpoint.resume and has_checkpoint(run_dir)
    if cfg.train.format_warmstart_steps and not resuming:
        warmstart(cfg, trainer, model, run_dir)
    ckpt = open_checkpoints(cfg, run_dir)
    meta = resume_latest(ckpt, trainer) if (ckpt is not None and cfg.checkpoint.resume) else {}
    return trainer, ckpt, meta


def warmstart(cfg: Any, trainer: Any, model: Any, run_dir: str) -> None:
    """Format warm-start SFT (`train.format_warmstart_steps`), cached on disk; keeps the trainer's RNG."""
    from asyncrl.models.sources import cache_dir, load_tokenizer
    from asyncrl.train.warmstart import cached_format_warmstart

    # Every trainer host computes the same thing (same seed, same data), so no broadcast is needed.
    params = cached_format_warmstart(
        model, trainer.params_for_inference(jnp.float32), load_tokenizer(cfg.model, run_dir),
        build_task(cfg.task), cfg.task, cfg.train.format_warmstart_steps, cache_dir(), cfg.run.seed,
        chat=cfg.task.prompt_template == "chat", lr=cfg.train.format_warmstart_lr,
        batch=cfg.train.format_warmstart_batch, source=repr(cfg.model))
    rng = trainer.rng
    trainer.load(params)
    trainer.rng = rng
