"""Learning through the endpoint: an agent written with the `openai` client (`tests.endpoint_agents:lookup_agent`)
offers the tiny model a `lookup` tool, which alone tells the hidden letter of the lookup task (`envs/lookup.py`); the
agent hands the tool's result back as a `tool` message and its final answer is graded by the task's verifier. Trained
by GRPO on what the endpoint sampled, the reward goes from <= 0.1 (a guess is right 1 time in 26; the tool is rarely
called) to >= 0.9, and the share of episodes that call the tool rises with it.

In one process, no Ray, with the components `environment: agent` uses on a run's inference host
(`endpoint.host.HostAgents`): the `EngineLoop` over the engine, the aiohttp `EndpointServer` on loopback with its
sessions (each episode's calls continued token-exact on the engine, from the parked cache), the `AgentRunner` (an
agent thread each) and the group pool, the agent named by import path (`agent.fn`), the verifier grading its text
answer, and the folded groups trained by the `Trainer`. The engine is driven by `EngineLoop`'s own decode thread,
which makes the calls of the inference worker's replica loop (`take`, `generate(drain=False)`, `advance`, `finish`),
and new weights go in through the engine's `between_loops` hook, as the worker swaps them. Every call is a real HTTP
request.

The chat template is a compact one written for the tiny model (one-letter role tags; tools listed by name; Qwen3's
`<tool_call>` format, native), so that an episode fits in 64 tokens. The warm-start (`EndpointLayout`) lays out
episodes exactly as the endpoint does (its `ChatFormat` and `ObservationRenderer`) and teaches the format of both
ways, and to copy a tool's result into the answer; the decision to call the tool is trained at a small weight, so the
warm-started policy calls it a few % of the time. RL learns to call the tool."""

from __future__ import annotations

import itertools
import queue
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.endpoint.chat import ChatFormat
from asyncrl.endpoint.config import AgentConfig, EndpointConfig
from asyncrl.endpoint.host import HostAgents
from asyncrl.envs.chat import ObservationRenderer
from asyncrl.envs.lookup import LETTERS, LookupTask
from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine
from asyncrl.models import Model, preset
from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer
from asyncrl.orchestration.collect import collect_rollouts
from asyncrl.orchestration.staleness import Staleness
from asyncrl.rollout import Prompt, Rollout
from asyncrl.tasks import Verifier, VerifierConfig
from asyncrl.train.batch import build_batch
from asyncrl.train.config import MeshConfig, ShardingConfig, TrainConfig
from asyncrl.train.loss_config import LossConfig
from asyncrl.train.trainer import Trainer
from asyncrl.train.warmstart import format_warmstart
from tests.endpoint_agents import LOOKUP_TOOLS

PROMPTS, GROUP = 8, 8
EVAL_PROMPTS, EVAL_N = 64, 8
CALL = '<tool_call>{"name":"lookup"}</tool_call><|im_end|>'
DECIDE = 1 / 20  # the warm-start's weight on the call's first token: the policy then calls the tool ~3% of the time
TEMPLATE = (
    "{% if tools %}<|im_start|>s\n{% for t in tools %}{{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role[0] }}\n{{ m.content or '' }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name":"{{ c.function.name }}"}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>a\n{% endif %}"
)


def compact_tokenizer(folder: str) -> Tokenizer:
    """The character tokenizer, its turns ended by `<|im_end|>` (its EOS, as Qwen3's), `<tool_call>` and
    `</tool_call>` one token each (as in Qwen3's vocabulary), and `TEMPLATE`."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(build_char_tokenizer(folder), eos_token="<|im_end|>")
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    hf.chat_template = TEMPLATE
    return Tokenizer(hf)


class EndpointLayout:
    """The warm-start's examples in the endpoint's own layout: the prompt as the server renders it, a sampled turn,
    a tool's result as the session's observation ids. Half call the tool and copy its result (the call's first token,
    the decision, weighted `DECIDE`); half answer at once with a random letter."""

    def __init__(self, task: LookupTask, tok: Tokenizer):
        self.task, self.chat = task, ChatFormat(tok)
        self.renderer = ObservationRenderer(tok, self.chat.format.turn_end, **self.chat.template_kwargs(LOOKUP_TOOLS))

    def warmstart_examples(self, tokenizer: Tokenizer, n: int, seed: int, chat: bool) -> list:
        rng = random.Random(seed)
        call = tokenizer.encode(CALL)
        out = []
        for s, _ in zip(self.task.samples("train", seed), range(n)):
            ids = self.chat.prompt_ids([{"role": "user", "content": s.prompt}], LOOKUP_TOOLS)
            mask = [0.0] * len(ids)
            letter = "".join(rng.choice(LETTERS) for _ in s.answer)
            if rng.random() < 0.5:
                obs = self.renderer.after(call, [{"role": "tool", "tool_call_id": "call_0", "content": s.answer}])
                ids, mask = ids + call + obs, mask + [DECIDE] + [1.0] * (len(call) - 1) + [0.0] * len(obs)
                letter = s.answer
            answer = tokenizer.encode(letter) + [tokenizer.eos_id]
            out.append((ids + answer, mask + [1.0] * len(answer)))
        return out


def _poll(done: queue.Queue, timeout: float) -> Rollout | None:
    try:
        return done.get(timeout=timeout)
    except queue.Empty:
        return None


@pytest.mark.slow
def test_rl_through_the_endpoint_learns_to_call_the_tool(tmp_path):
    tok = compact_tokenizer(str(tmp_path / "tok"))
    model = Model(preset("tiny"))
    assert tok.vocab_size <= model.cfg.vocab_size
    task = LookupTask(eval_size=EVAL_PROMPTS)
    verifier = Verifier(task, VerifierConfig(mode="exact", workers=0))
    icfg = InferenceConfig(group_size=GROUP, max_decode_batch_size=64, max_prefill_prompts=16, max_seq_len=64,
                           min_prefill_bucket=32, temperature=1.0, params_dtype="float32", kv_cache_dtype="float32",
                           max_turns=2, max_new_tokens=24, extend_wait_s=0.0)
    # Token sums over a constant (Dr. GRPO), not each sequence's mean: under a mean, the decision token of a 20-token
    # call turn got 1/10 of the push the first token of a 2-token answer got, and lucky guesses (1 in 26) outweighed
    # the rarer rewarded calls: the policy collapsed onto answering at once (measured).
    loss_cfg = LossConfig(name="grpo", max_tokens=icfg.generation_budget, normalization="constant")
    train_cfg = TrainConfig(train_batch_size=PROMPTS * GROUP, lr=2e-3, total_steps=80, pad_to_multiple=16,
                            warmup_steps=2, max_grad_norm=1.0)
    trainer = Trainer(model, train_cfg, loss_cfg, ShardingConfig(mesh=MeshConfig(dp=1, fsdp=1)),
                      devices=jax.devices()[:1])
    start = format_warmstart(model, model.init_params(jax.random.PRNGKey(0)), tok, EndpointLayout(task, tok), 200,
                             lr=3e-3, seed=0)
    trainer.load(start)
    engine = Engine(model, start, icfg, tok, seed=0)

    weights: queue.Queue = queue.Queue()

    def swap() -> None:  # on the decode thread, between decode loops: the inference worker's `_maybe_update`
        while not weights.empty():
            engine.set_params(*weights.get())

    engine.between_loops = swap
    done: queue.Queue[Rollout] = queue.Queue()
    errors: list[BaseException] = []
    agent = AgentConfig(fn="tests.endpoint_agents:lookup_agent", timeout_s=120, workers=PROMPTS * GROUP)
    host = HostAgents(engine, EndpointConfig(max_sessions=PROMPTS * GROUP), agent, GROUP, done.put, errors.append,
                      grade=lambda answer, s: float(verifier.submit(answer, s).result(timeout=30).reward))
    host.loop.start()
    host.start()

    def check() -> None:
        if errors or host.loop.error is not None:
            raise RuntimeError(f"the host failed: {errors or host.loop.error!r}")

    def evaluate() -> tuple[float, float]:
        samples = list(task.samples("eval", 0))
        for i, s in enumerate(samples):
            host.submit(Prompt.for_eval(i, s, EVAL_N, 0))
        comps = []
        for _ in samples:
            r = done.get(timeout=300)
            check()
            comps += r.completions
        assert len(comps) == EVAL_PROMPTS * EVAL_N and all(c.end_reason == "done" for c in comps), \
            sorted({c.end_reason for c in comps})
        return float(np.mean([c.reward for c in comps])), float(np.mean([c.n_turns > 1 for c in comps]))

    try:
        t0 = time.perf_counter()
        before, called_before = evaluate()
        stream = task.samples("train", 0)
        rewards, called = [], []
        for step in range(train_cfg.total_steps):
            positions = range(step * PROMPTS, (step + 1) * PROMPTS)
            for p, s in zip(positions, itertools.islice(stream, PROMPTS)):
                host.submit(Prompt(p, s, GROUP))
            kept, metrics_host = collect_rollouts(lambda t: _poll(done, t), PROMPTS, trainer.version, Staleness(0),
                                                  check=check, timeout_s=300)
            metrics = trainer.step(build_batch(kept, loss_cfg, train_cfg.pad_to_multiple), metrics_host)
            # Every trained token was sampled by the engine at the weights the trainer scores it with: on-policy
            # importance ratios are 1 (the trajectories are the sampled ids, token-exact).
            assert metrics["train/is_ratio_min"] == pytest.approx(1.0, abs=1e-3), metrics["train/is_ratio_min"]
            assert metrics["train/is_ratio_max"] == pytest.approx(1.0, abs=1e-3), metrics["train/is_ratio_max"]
            weights.put((jax.tree.map(np.asarray, trainer.params_for_inference(jnp.float32)), trainer.version))
            deadline = time.monotonic() + 60
            while engine.version != trainer.version:  # the next step samples with the new weights (max_lag 0)
                assert time.monotonic() < deadline, "the decode thread never took the new weights"
                time.sleep(0.01)
            rewards.append(metrics["rollout/reward_mean"])
            called.append(metrics["rollout/multi_turn_share"])
            if len(rewards) >= 5 and np.mean(rewards[-5:]) >= 0.95:
                break
        after, called_after = evaluate()
        curve = " ".join(f"{r:.2f}/{c:.2f}" for r, c in zip(rewards, called))
        print(f"agent learning: eval {before:.3f} -> {after:.3f}, tool calls {called_before:.3f} -> "
              f"{called_after:.3f}, {len(rewards)} steps in {time.perf_counter() - t0:.0f} s; per step, "
              f"reward/tool-call share: {curve}")
    finally:
        host.close()
        host.loop.stop()
        verifier.close()
    assert before <= 0.1, before  # a guess is right 1 time in 26; the tool is rarely called
    assert after >= 0.9, (after, rewards)
    assert called_before < 0.1 and called_after > 0.9, (called_before, called_after)
