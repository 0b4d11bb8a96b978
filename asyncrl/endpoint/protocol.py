"""Requests of the OpenAI API, parsed and checked: a bad field gets an `ApiError` (4xx) whose message names it.

The decode program is the engine's own (no second decode loop), compiled with the run's temperature, per-turn cap
and stop sequences, and it records only the sampled token's logprob. Fields asking for something else are refused
by name under `endpoint.strict_sampling`, not silently served differently (`Limits`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.endpoint.config import EndpointConfig

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


class ApiError(Exception):
    """An answer other than 200: the status, and OpenAI's error body (`message`, `type`, `param`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Limits:
    """What the engine's compiled decode program does, for checking requests against it."""

    temperature: float
    max_seq_len: int
    max_new_tokens: int | None  # the per-turn cap; None: only the context limits a turn
    stop: tuple[str, ...] = ()  # texts the program ends a turn at besides EOS


@dataclass
class Sampling:
    n: int = 1
    max_tokens: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    sampling: Sampling = field(default_factory=Sampling)
    session: str | None = None  # the episode this call belongs to (part of an agent's trajectory)


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling = field(default_factory=Sampling)


def _bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(key, f"must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}")
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(key, f"must be true or false, got {v!r}")
    return v


def _sampling(body: dict, cfg: EndpointConfig, lim: Limits, logprobs: bool) -> Sampling:
    strict = cfg.strict_sampling
    for key, run in (("temperature", lim.temperature), ("top_p", 1.0)):
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _bad(key, f"must be a number, got {v!r}")
        if strict and abs(float(v) - run) > 1e-6:
            raise _bad(key, f"the engine samples at {key}={run} (the trainer's logprobs assume it); got {v!r}")
    n = _int(body, "n", 1)
    if n is not None and n > cfg.max_n:
        raise _bad("n", f"at most endpoint.max_n={cfg.max_n} choices a request, got {n}")
    mt = _int(body, "max_completion_tokens", 1)
    mt = _int(body, "max_tokens", 1) if mt is None else mt
    cap = lim.max_new_tokens
    if strict and mt is not None and cap is not None and mt < cap:
        raise _bad("max_tokens", f"the engine ends a turn at inference.max_new_tokens={cap} tokens; a request may "
                                 f"not ask for fewer (got {mt})")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
            raise _bad("stop", f"must be a string or a list of at most 4 strings, got {stop!r}")
        extra = [s for s in stops if s not in lim.stop]
        if strict and extra:
            raise _bad("stop", f"the engine stops turns only at EOS and {list(lim.stop)}; not at {extra}")
    if logprobs:
        tl = _int(body, "top_logprobs", 0, 20)
        if tl:
            raise _bad("top_logprobs", "the engine records the sampled token's logprob only; give 0 or omit it")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"must be an integer, got {seed!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    return Sampling(n=n or 1, max_tokens=mt, logprobs=logprobs, stream=_bool(body, "stream"),
                    include_usage=bool(opts.get("include_usage")), seed=seed)


def check_model(body: Any, cfg: EndpointConfig) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", f"a model name is required (this server serves {cfg.model!r})")
    if model != cfg.model:
        raise ApiError(404, f"model: unknown model {model!r}; this server serves {cfg.model!r}", "model",
                       "model_not_found")
    return body


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, "must be an object with a role")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {list(ROLES)}, got {role!r}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text can reach a text model
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise _bad(f"{where}.content", "only text parts ({'type': 'text', 'text': ...}) are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise _bad(f"{where}.content", f"must be a string, a list of text parts or null, got {type(content).__name__}")
    calls = m.get("tool_calls") or []
    if calls and role != "assistant":
        raise _bad(f"{where}.tool_calls", "only an assistant message carries tool calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise _bad(f"{where}.tool_calls", "must be a list of {'type': 'function', 'function': {...}} objects")
    if content is None and not calls:
        raise _bad(f"{where}.content", "is required (null only for an assistant message with tool_calls)")
    out = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def parse_chat(body: Any, cfg: EndpointConfig, lim: Limits) -> ChatRequest:
    body = check_model(body, cfg)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of messages")
    messages = [_message(i, m) for i, m in enumerate(msgs)]
    if messages[-1]["role"] == "assistant":
        raise _bad("messages", "the last message must not be the assistant's: the engine writes the next one")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise _bad("tools", "must be a list of {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        # The decode program cannot constrain what the model writes; a forced call would be a promise not kept.
        raise _bad("tool_choice", f"only 'auto' and 'none' are supported (nothing is constrained), got {choice!r}")
    session = body.get("session_id")
    if session is not None and not isinstance(session, str):
        raise _bad("session_id", "must be a string")
    logprobs = _bool(body, "logprobs")
    return ChatRequest(messages, tools, choice, _sampling(body, cfg, lim, logprobs), session)


def parse_completion(body: Any, cfg: EndpointConfig, lim: Limits) -> CompletionRequest:
    body = check_model(body, cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    ok = isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not ok:
        raise _bad("prompt", "must be a non-empty string or list of token ids (one prompt a request)")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
        raise _bad("logprobs", f"must be an integer in [0, 5], got {lp!r}")
    if lp:
        raise _bad("logprobs", "the engine records the sampled token's logprob only; give 0 or omit it")
    return CompletionRequest(prompt, _sampling(body, cfg, lim, lp == 0))
