"""The trained policy as a Hugging Face folder (`checkpoint.export_hf`): what transformers and vLLM read."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from asyncrl.models.section import ModelSection

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template", "vocab", "merges")


def export_hf(model: ModelSection, trainer: Any, run_dir: str, rank: int) -> str:
    """Write `trainer`'s params to run_dir/hf (collective over the trainer mesh: every trainer host calls it), and
    on rank 0 copy the tokenizer of the run's `model` section beside them. Returns the folder. With LoRA,
    run_dir/hf holds the merged model and run_dir/hf_adapter the adapter alone, in PEFT's format
    (`peft.PeftModel.from_pretrained(base, folder)`)."""
    import jax
    import jax.numpy as jnp

    from asyncrl.models import lora, save_pretrained
    from asyncrl.models.sources import load_tokenizer, resolve_path
    from asyncrl.sharding.host import to_host

    out = os.path.join(run_dir, "hf")
    if trainer.lora is None:
        save_pretrained(trainer.model, trainer.params, out)
    else:
        save_pretrained(trainer.model, trainer.params_for_inference(jnp.float32), out)
        adapters = jax.tree.map(to_host, trainer.params)  # collective: every trainer host takes part
        if rank == 0:
            lc = trainer.lora
            lora.save_peft(os.path.join(run_dir, "hf_adapter"), trainer.model.cfg, adapters, lc.rank, lc.alpha,
                           base_model=model.path or None)
    if rank == 0:
        src = model.tokenizer or resolve_path(model)
        if src is None:  # presets train with the character tokenizer built in the run dir
            load_tokenizer(model, run_dir)
            src = os.path.join(run_dir, "char_tokenizer")
        for f in os.listdir(src):
            if f.startswith(TOKENIZER_FILES):
                shutil.copy(os.path.join(src, f), os.path.join(out, f))
        log.info("exported the final policy to %s", out)
    return out
