"""Format warm-start: a short SFT that teaches the *answer format* but not the task, so RL has signal to work with.

A model trained from random init never emits "one digit, then EOS", so its reward is exactly 0 and every
advantage is 0. We fine-tune on train prompts paired with answers drawn at random from the task's answer set: the
model learns what an answer looks like and where to stop, while the prompt-to-answer rule stays unlearned
(its eval reward stays at chance). Everything the eval curve gains afterwards comes from the RL loop.
The result is cached (a Hugging Face folder) keyed by everything that determines it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asyncrl.sharding.host import to_host

log = logging.getLogger(__name__)


def _examples(task: Any, tokenizer: Any, n: int, seed: int, chat: bool) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) pairs: the prompt masked out, a random answer in the task's format and EOS masked
    in; a multi-turn task lays out its own episodes (`warmstart_examples`)."""
    if hasattr(task, "warmstart_examples"):
        return task.warmstart_examples(tokenizer, n, seed, chat)
    samples = list(itertools.islice(task.samples("train", seed), n))
    # Labels drawn uniformly from the distinct gold answers, independent of the prompt: format only. (Shuffling
    # the gold answers would also teach their marginal, e.g. "say 9" for max-of-digits, which is a partial
    # solution the RL curve should have to find itself.)
    distinct = sorted({s.answer for s in samples})
    rng = random.Random(seed)
    answers = [rng.choice(distinct) for _ in samples]
    out = []
    for s, a in zip(samples, answers):
        target = task.render_answer(a, s)  # e.g. \boxed{a}: the format the task's scorer extracts
        prompt, answer = tokenizer.encode_prompt(s.prompt, chat=chat), tokenizer.encode(target) + [tokenizer.eos_id]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def format_warmstart(model: Any, params: Any, tokenizer: Any, task: Any, steps: int, *, lr: float = 3e-3,
                     batch: int = 64, seed: int = 0, chat: bool = False) -> Any:
    """Returns params after `steps` of masked next-token cross-entropy on (prompt, shuffled answer + EOS)."""
    examples = _examples(task, tokenizer, batch * 8, seed, chat)
    width = max(len(ids) for ids, _ in examples)
    toks = np.zeros((len(examples), width), np.int32)
    mask = np.zeros((len(examples), width), np.float32)
    lens = np.zeros((len(examples),), np.int32)
    for i, (ids, m) in enumerate(examples):
        toks[i, : len(ids)] = ids
        mask[i, : len(ids)] = m  # targets: the model's tokens (answers, EOS), never prompts or observations
        lens[i] = len(ids)
    tx = optax.adam(lr)
    # Whole on this host: with several trainer hosts the params span devices of other processes, which a plain
    # device_get cannot read. Every trainer host calls this (same seed, same data), so the gather is collective.
    params = jax.tree.map(to_host, params)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, t, m, n):
        def loss_fn(p):
            lp = model.get_logprobs(p, t, n)  # [B, T-1]: logprob of token t+1
            return -jnp.sum(lp * m[:, 1:]) / jnp.sum(m[:, 1:])

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss

    rng = np.random.default_rng(seed)
    for done in range(1, steps + 1):
        idx = rng.choice(len(examples), size=batch, replace=False)
        params, opt, loss = step(params, opt, toks[idx], mask[idx], lens[idx])
        if done == 1 or done % 10 == 0 or done == steps:  # the last at INFO: one line on the console
            log.log(logging.INFO if done == steps else logging.DEBUG, "format warm-start: step %d/%d, loss %.3f",
                    done, steps, float(loss))
    return params


def cached_format_warmstart(model: Any, params: Any, tokenizer: Any, task: Any, task_key: object, steps: int,
                            cache_root: str, seed: int, chat: bool = False, lr: float = 3e-3, batch: int = 64,
                            source: str = "") -> Any:
    """`source` names where the starting params came from (the model section: path, source, dtype); with the
    model config, `task_key` (whose repr names the task: its config), the run seed and the warm-start settings it
    keys the cache."""
    from asyncrl.models import from_pretrained, save_pretrained

    key = json.dumps({"v": 3, "model": repr(model.cfg), "source": source, "task": repr(task_key), "steps": steps,
                      "seed": seed, "chat": chat, "vocab": tokenizer.vocab_size, "lr": lr, "batch": batch},
                     sort_keys=True)
    folder = os.path.join(cache_root, "warmstart-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    # Complete only if it has its config: a folder another version left empty (a second trainer host renamed its
    # unwritten temp dir into place) is computed again and replaced, never read.
    if os.path.isfile(os.path.join(folder, "config.json")):
        log.info("format warm-start: cached at %s", folder)
        return from_pretrained(folder)[1]
    out = format_warmstart(model, params, tokenizer, task, steps, lr=lr, batch=batch, seed=seed, chat=chat)
    # Every trainer host computes the same params; only process 0 writes files (save_pretrained), so only it fills
    # the cache.
    if jax.process_index() != 0:
        return out
    tmp = folder + f".tmp{os.getpid()}"
    save_pretrained(model, out, tmp)
    if os.path.isfile(os.path.join(folder, "config.json")):  # another process finished first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder, if any
        os.replace(tmp, folder)
    return out
