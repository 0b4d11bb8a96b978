"""Episodes with tools: each model turn either calls tools or answers.

    prompt   the task's question, with the tools offered (through the chat template's `tools=`, or, for a template
             that renders none, the Qwen3 tool preamble as a system message)
    turn k   a tool call in the model family's format (`asyncrl/tools/calls.py`)
    obs      each call's result as the template's tool message, token-exact (`ObservationRenderer`)
    ...
    turn n   no call: the answer, graded by the task's verifier (the episode's reward)

A call runs in the sandbox (`asyncrl/tools/sandbox.py`: its own process, no network, no files outside a scratch
directory, limits on CPU, memory, processes, output and wall time). A malformed call, an unknown tool, missing
arguments, a tool error or a timeout is an error observation the model reads; the episode goes on. A call on the
last turn the engine allows cannot be answered: the episode ends unanswered (reward 0, reason "no_answer").

Each step's `info["tools"]` lists its calls (name, error kind, latency): the tool metrics (`episode_metrics`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from asyncrl.envs.chat import ObservationRenderer
from asyncrl.rollout import StepResult, Turn
from asyncrl.tools.calls import (
    TOOLS,
    CallError,
    Llama31Format,
    ToolCall,
    format_for,
    template_has_tools,
    tools_instruction,
)
from asyncrl.tools.config import ToolsConfig

RESULT_LOG_CHARS = 300  # of each result, kept in the step's info (rollouts.jsonl), for transcripts


class Toolbox:
    """What the episodes of one process share: the tools, their call format, the prompt and observation rendering,
    and the sandbox's worker pool (started on the first call)."""

    def __init__(self, cfg: ToolsConfig, tokenizer: Any, chat: bool) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools = [TOOLS[name] for name in cfg.tools]
        self.chat = chat and tokenizer.has_chat_template
        template = tokenizer.hf.chat_template if self.chat else None
        self.format = format_for(cfg.format, template)
        # A template that renders `tools=` itself gets them there; any other prompt carries the Qwen3 preamble.
        self.native = self.chat and template_has_tools(template)
        if self.native and self.format.name != format_for("auto", template).name:
            raise ValueError(f"tools.format={cfg.format!r} contradicts the chat template, which writes "
                             f"{format_for('auto', template).name} calls: use tools.format=auto")
        self.kw = self.format.template_kwargs(self.tools) if self.native else {}
        # The turn end is the format's where the template writes that format; elsewhere the template's own (EOS).
        turn_end = self.format.turn_end if self.native else None
        self.renderer = ObservationRenderer(tokenizer, turn_end, **self.kw) if self.chat else None
        if self.renderer is not None:  # a template observations cannot be cut from fails here, not at every call
            self.renderer.text(self.format.result_messages(ToolCall(self.tools[0].name, {}), "probe"))
        if cfg.require_kernel_sandbox:
            from asyncrl.tools.sandbox import PythonSandbox

            layers = PythonSandbox.layers()
            missing = [k for k in ("landlock", "seccomp") if not layers.get(k)]
            if missing:
                raise RuntimeError(f"the tool sandbox needs {' and '.join(missing)} (Linux >= 5.13 with Landlock "
                                   "enabled), missing here; tools.require_kernel_sandbox=false runs calls behind "
                                   "Python audit hooks instead, which are not a security boundary")
        self._sandbox = None
        self._lock = threading.Lock()

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not self.native:
            if not self.chat:  # a plain prompt (the tiny model's character tokenizer): preamble, then the question
                text = tools_instruction(self.tools) + "\n\n" + "\n".join(m["content"] for m in messages) + "\n"
                return self.tokenizer.encode_prompt(text, chat=False)
            preamble = tools_instruction(self.tools)
            if messages and messages[0]["role"] == "system":  # the task's own system prompt, then the tools
                messages = [{"role": "system", "content": messages[0]["content"] + "\n\n" + preamble}] + messages[1:]
            else:
                messages = [{"role": "system", "content": preamble}] + messages
        text = self.tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.kw)
        return self.tokenizer.encode(text)

    @property
    def sandbox(self) -> Any:
        with self._lock:
            if self._sandbox is None:
                from asyncrl.tools.sandbox import PythonSandbox, SandboxLimits

                c = self.cfg
                limits = SandboxLimits(wall_s=c.wall_s, cpu_s=c.cpu_s, memory_mb=c.memory_mb,
                                       output_bytes=c.output_bytes)
                self._sandbox = PythonSandbox(limits, workers=c.workers,
                                              require_kernel_layers=c.require_kernel_sandbox)
            return self._sandbox

    def run(self, calls: Sequence[ToolCall | CallError]) -> list[tuple[str, str | None, float]]:
        """Each call's (result text, error kind or None, latency), the calls of one turn at once in the pool. (A turn
        the engine stopped at its first call's end holds one call; the cap matters where a format has no stop.)"""
        futures = []
        for i, call in enumerate(calls):
            if i >= self.cfg.max_calls_per_turn:
                futures.append(("Error (too_many_calls): at most "
                                f"{self.cfg.max_calls_per_turn} tool calls per turn", "too_many_calls", 0.0))
            elif isinstance(call, CallError):
                futures.append((f"Error ({call.kind}): {call.message}", call.kind, 0.0))
            else:  # the only tool today: python
                futures.append(self.sandbox.submit(call.arguments["code"]))
        out = []
        for f in futures:
            if isinstance(f, tuple):
                out.append(f)
                continue
            r = f.result()
            out.append((r.output, r.error, r.latency_s))
        return out

    def observation(self, turn_tokens: Sequence[int], calls: Sequence[ToolCall | CallError],
                    results: Sequence[str]) -> list[int]:
        if self.renderer is None:
            body = "".join(f"<tool_response>\n{r}\n</tool_response>\n" for r in results)
            return self.tokenizer.encode("\n" + body)
        messages = [m for call, r in zip(calls, results) for m in self.format.result_messages(call, r)]
        return self.renderer.after(turn_tokens, messages)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


class ToolEnv:
    """A single-turn environment's answer, after turns that may call the run's tools (a source with `tools: true`).
    Its turns end on the run's call format's stop texts (`Environments.stop_sequences` asks the toolbox)."""

    def __init__(self, prompt_ids: Sequence[int], sample: Any, verifier: Any, timeout_s: float, tokenizer: Any,
                 toolbox: Toolbox) -> None:
        """`prompt_ids`: the question with the tools offered (`Toolbox.prompt_ids`, as `Environments.open` gives)."""
        self.prompt_ids, self.sample, self.verifier = list(prompt_ids), sample, verifier
        self.timeout_s, self.toolbox = timeout_s, toolbox

    def reset(self) -> list[int]:
        return list(self.prompt_ids)

    def step(self, turn: Turn) -> StepResult:
        box = self.toolbox
        # Parsed from the ids with their special tokens (Llama's <|python_tag|> is one; `turn.text` drops it).
        calls = box.format.parse(box.tokenizer.decode(turn.tokens, skip_special_tokens=False), box.tools)
        if not calls:  # the answer
            score = self.verifier.submit(turn.text, self.sample).result(timeout=self.timeout_s)
            return StepResult(None, float(score.reward), True, score.reason)
        if turn.last:  # no turn left to read the result in
            return StepResult(None, 0.0, True, "no_answer",
                              {"tools": [{"name": getattr(c, "name", None), "error": "no_turn_left",
                                          "latency_s": 0.0} for c in calls]})
        results = box.run(calls)
        info = {"tools": [{"name": getattr(c, "name", None), "error": err, "latency_s": round(lat, 4),
                           "result": text[:RESULT_LOG_CHARS]} for c, (text, err, lat) in zip(calls, results)]}
        obs = box.observation(turn.tokens, calls, [text for text, _, _ in results])
        return StepResult(obs, 0.0, False, None, info)


class ToolWarmstart:
    """The task as the format warm-start (`asyncrl/train/warmstart.py`) sees it when its episodes use tools: the
    examples lay out the episode's own tokens (prompt with the tools, turns masked in, tool results masked out).

    Format only, as for every warm-start: half the examples call the python tool, on random operands (never the
    question's), read its true result for those, and answer; half answer at once. Every answer is drawn at random
    from the task's answers. What RL must find is the rule: call with the question's own operands, then copy the
    result."""

    LAYOUT = 2  # in the warm-start's cache key: bumped whenever these examples change

    def __init__(self, task: Any, toolbox: Toolbox, tool_labels: set[str]) -> None:
        """`tool_labels`: the labels of the sources played with tools (a mixture's other sources answer at once)."""
        self.task, self.toolbox, self.tool_labels = task, toolbox, set(tool_labels)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def warmstart_examples(self, tokenizer: Any, n: int, seed: int, chat: bool) -> list[tuple[list[int], list[int]]]:
        import itertools
        import json
        import random

        rng = random.Random(seed)
        samples = list(itertools.islice(self.task.samples("train", seed), n))
        answers = sorted({s.answer for s in samples})
        box, eos = self.toolbox, [tokenizer.eos_id]
        out = []
        for s in samples:
            answer = tokenizer.encode(self.task.render_answer(rng.choice(answers), s)) + eos
            if s.metadata.get("task", self.task.label) not in self.tool_labels:
                prompt = tokenizer.encode_prompt(s.prompt, chat=chat)
                out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
                continue
            ids = box.prompt_ids(s.prompt)
            mask = [0] * len(ids)
            if rng.random() < 0.5:
                a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
                args = {"code": f"print({a} * {b})"}
                if isinstance(box.format, Llama31Format):
                    call_text = f"<|python_tag|>{args['code']}<|eom_id|>"  # the model ends the call itself
                else:
                    call_text = "<tool_call>\n" + json.dumps({"name": "python", "arguments": args}) + "\n</tool_call>"
                call = tokenizer.encode(call_text)
                obs = box.observation(call, [ToolCall("python", args)], [f"{a * b}\n"])  # as print() writes it
                ids, mask = ids + call + obs, mask + [1] * len(call) + [0] * len(obs)
            out.append((ids + answer, mask + [1] * len(answer)))
        return out
