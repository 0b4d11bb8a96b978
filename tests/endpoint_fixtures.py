"""Shared by the endpoint tests: a Qwen3 tokenizer and template, and a tiny model built to answer every assistant
turn with one fixed tool call (so a random-weight model still exercises tool calls), served on loopback."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl.endpoint.chat import ChatFormat
from asyncrl.endpoint.config import EndpointConfig
from asyncrl.endpoint.loop import EngineLoop
from asyncrl.endpoint.server import EndpointServer
from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine
from asyncrl.models import Model, preset
from asyncrl.models.tokenizer import Tokenizer
from tests.helpers import build_qwen3_tokenizer

CALL = '<tool_call>{"name":"add","arguments":{"x":1}}</tool_call><|im_end|>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add one to x.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
CFG = InferenceConfig(group_size=1, max_decode_batch_size=4, max_prefill_prompts=2, max_seq_len=384,
                      temperature=0.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16,
                      max_turns=4, max_new_tokens=16, extend_wait_s=0.0)


def qwen3_tokenizer(folder: str) -> Tokenizer:
    return Tokenizer.from_folder(build_qwen3_tokenizer(folder))


def tool_call_model(tok: Tokenizer, scale: float = 6.0) -> tuple[Model, object]:
    """Attention and MLP write nothing (wo = w_down = 0), so a position's residual is its token's embedding and the
    LM head reads the next token from it: a bigram table. After the assistant header's "\\n" it writes `CALL`,
    whose tokens are all distinct (so each has one successor), and ends with `<|im_end|>`. `scale`: the successor's
    logit (6: greedy decoding follows the chain; 20: sampling at temperature 1 follows it with p ~0.99 a token)."""
    (nl,) = tok.encode("\n")
    chain = [nl] + tok.encode(CALL)
    assert len(set(chain)) == len(chain)
    model = Model(dataclasses.replace(preset("tiny"), vocab_size=tok.vocab_size, tie_word_embeddings=False))
    p = model.init_params(jax.random.PRNGKey(0))
    embed = np.random.default_rng(0).normal(size=(tok.vocab_size, p.embed.shape[1])).astype(np.float32)
    embed /= np.linalg.norm(embed, axis=1, keepdims=True)
    head = np.zeros(p.lm_head.shape, np.float32)
    for a, b in zip(chain, chain[1:]):
        head[:, b] = scale * embed[a]
    layers = dataclasses.replace(p.layers, wo=jnp.zeros_like(p.layers.wo), w_down=jnp.zeros_like(p.layers.w_down))
    return model, dataclasses.replace(p, embed=jnp.asarray(embed), lm_head=jnp.asarray(head), layers=layers)


def serve(model: Model, params: object, tok: Tokenizer, cfg: EndpointConfig | None = None,
          inference: InferenceConfig = CFG) -> EndpointServer:
    engine = Engine(model, params, inference, tok, seed=0)
    cfg = cfg or EndpointConfig()
    loop = EngineLoop(engine, cfg.max_queued, cfg.max_sessions)
    loop.start()
    server = EndpointServer(cfg or EndpointConfig(), loop, ChatFormat(tok))
    server.start()
    return server


def shutdown(server: EndpointServer) -> None:
    server.stop()
    server.loop.stop()


def served_tool_call_model(tmp_path_factory):
    """The module fixture of both endpoint test files: (tok, model, params, server, openai client), the server
    shut down after the module."""
    import openai

    tok = qwen3_tokenizer(str(tmp_path_factory.mktemp("qwen3")))
    model, params = tool_call_model(tok)
    server = serve(model, params, tok)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    yield tok, model, params, server, client
    shutdown(server)
