"""Response bodies of the OpenAI API, whole or as server-sent-event chunks, from sampled turns.

Beside the standard fields, as vLLM and SGLang do for RL (`return_token_ids`, `model_version`), every choice carries
the turn's exact ids and, per token, the sampler's logprob, whether the engine forced it, and the weight version
that produced it (a turn can span a weight update); the response carries the prompt's ids. An agent or a test can
then check that what it was told is what was sampled, without re-tokenizing anything."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.endpoint.chat import Reply
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.rollout import Completion


@dataclass
class TurnOut:
    """One sampled turn of a choice: its ids and their per-token records."""

    tokens: np.ndarray
    logprobs: np.ndarray
    forced: np.ndarray
    versions: np.ndarray
    hit_length: bool

    @staticmethod
    def last_turn(c: Completion) -> TurnOut:
        """The completion's last model turn (all of it for a single-turn episode)."""
        sel = np.ones(len(c.tokens), bool) if c.turns is None else (c.turns == c.turns.max())
        if c.observation is not None:
            sel &= ~c.observation
        return TurnOut(c.tokens[sel], c.logprobs[sel], c.forced[sel], c.versions[sel], c.finish_reason == "length")

    def extra(self) -> dict[str, Any]:
        return {"token_ids": self.tokens.tolist(), "token_logprobs": self.logprobs.astype(float).tolist(),
                "token_forced": self.forced.tolist(), "token_versions": self.versions.tolist()}


class Bodies:
    """The bodies of one response: its id, model name and creation time shared by every chunk."""

    def __init__(self, model: str, tokenizer: Tokenizer, kind: str):
        self.model, self.tokenizer, self.kind = model, tokenizer, kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _pieces(self, tokens: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([int(t)], skip_special_tokens=False) for t in tokens]

    def chat_logprobs(self, t: TurnOut) -> dict[str, Any]:
        return {"content": [{"token": p, "logprob": float(lp), "bytes": list(p.encode()), "top_logprobs": []}
                            for p, lp in zip(self._pieces(t.tokens), t.logprobs)]}

    @staticmethod
    def usage(prompt_len: int, turns: Sequence[TurnOut]) -> dict[str, int]:
        done = sum(len(t.tokens) for t in turns)
        return {"prompt_tokens": prompt_len, "completion_tokens": done, "total_tokens": prompt_len + done}

    def chat(self, prompt_ids: Sequence[int], choices: Sequence[tuple[Reply, TurnOut]], logprobs: bool,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
        out = []
        for i, (r, t) in enumerate(choices):
            msg: dict[str, Any] = {"role": "assistant", "content": r.content}
            if r.tool_calls:
                msg["tool_calls"] = r.tool_calls
            out.append({"index": i, "message": msg, "finish_reason": r.finish_reason,
                        "logprobs": self.chat_logprobs(t) if logprobs else None, **t.extra()})
        return {**self._head("chat.completion"), "choices": out,
                "usage": self.usage(len(prompt_ids), [t for _, t in choices]),
                "prompt_token_ids": list(map(int, prompt_ids)), **(extra or {})}

    def chat_chunks(self, prompt_ids: Sequence[int], choices: Sequence[tuple[Reply, TurnOut]], logprobs: bool,
                    include_usage: bool, extra: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """The stream of a finished response: per choice its role, content (with logprobs and ids), tool calls
        (id and name, then arguments, keyed by index) and finish reason; then the usage chunk if asked. The engine
        hands a turn over when its row leaves the decode batch, so the chunks come together at that moment."""
        head = self._head("chat.completion.chunk")
        first = {"prompt_token_ids": list(map(int, prompt_ids)), **(extra or {})}
        for i, (r, t) in enumerate(choices):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}], **(first if i == 0 else {})}
            yield {**head, "choices": [{"index": i, "delta": {"content": r.content or ""}, "finish_reason": None,
                                        "logprobs": self.chat_logprobs(t) if logprobs else None, **t.extra()}]}
            for j, c in enumerate(r.tool_calls):
                fn = c["function"]
                yield {**head, "choices": [{"index": i, "finish_reason": None, "delta": {"tool_calls": [
                    {"index": j, "id": c["id"], "type": "function", "function": {"name": fn["name"],
                                                                                "arguments": ""}}]}}]}
                yield {**head, "choices": [{"index": i, "finish_reason": None, "delta": {"tool_calls": [
                    {"index": j, "function": {"arguments": fn["arguments"]}}]}}]}
            yield {**head, "choices": [{"index": i, "delta": {}, "finish_reason": r.finish_reason}]}
        if include_usage:
            yield {**head, "choices": [], "usage": self.usage(len(prompt_ids), [t for _, t in choices])}

    def completion(self, prompt_ids: Sequence[int], turns: Sequence[TurnOut], texts: Sequence[str],
                   logprobs: bool) -> dict[str, Any]:
        out = []
        for i, (t, text) in enumerate(zip(turns, texts)):
            lp = None
            if logprobs:
                pieces = self._pieces(t.tokens)
                offsets = np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
                lp = {"tokens": pieces, "token_logprobs": t.logprobs.astype(float).tolist(), "top_logprobs": None,
                      "text_offset": offsets}
            out.append({"index": i, "text": text, "logprobs": lp,
                        "finish_reason": "length" if t.hit_length else "stop", **t.extra()})
        return {**self._head("text_completion"), "choices": out, "usage": self.usage(len(prompt_ids), turns),
                "prompt_token_ids": list(map(int, prompt_ids))}

    def completion_chunks(self, body: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
        for c in body["choices"]:
            yield {**self._head("text_completion"), "choices": [{**c, "finish_reason": None}]}
            yield {**self._head("text_completion"), "choices": [{"index": c["index"], "text": "",
                                                                 "finish_reason": c["finish_reason"]}]}
        if include_usage:
            yield {**self._head("text_completion"), "choices": [], "usage": body["usage"]}


def sse(event: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` (or `[DONE]`) and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
