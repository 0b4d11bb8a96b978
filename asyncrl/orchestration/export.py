"""The trained policy as a Hugging Face folder (`checkpoint.export_hf`): what transformers and vLLM read."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template", "vocab", "merges")


def export_hf(cfg: Any, trainer: Any, run_dir: str, rank: int) -> str:
    """Write `trainer`'s params to run_dir/hf (collective over the trainer mesh: every trainer host calls it), and
    on rank 0 copy the tokenizer beside them. Returns the folder."""
    from asyncrl.models import save_pretrained
    from asyncrl.models.sources import load_tokenizer, resolve_path

    out = os.path.join(run_dir, "hf")
    save_pretrained(trainer.model, trainer.params, out)
    if rank == 0:
        src = cfg.model.tokenizer or resolve_path(cfg.model)
        if src is None:  # presets train with the character tokenizer built in the run dir
            load_tokenizer(cfg.model, run_dir)
            src = os.path.join(run_dir, "char_tokenizer")
        for f in os.listdir(src):
            if f.startswith(TOKENIZER_FILES):
                shutil.copy(os.path.join(src, f), os.path.join(out, f))
        log.info("exported the final policy to %s", out)
    return out
