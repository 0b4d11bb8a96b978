"""Observation tokens through a chat template, token-exact.

After a model turn the conversation goes on with messages the environment adds (a tool's result, a user's reply).
Their token ids must be what the chat template puts after the model's own turn-end token: the template's turn
delimiters, the messages, and the next assistant header. They are rendered once, by difference: the template renders
a fixed dummy conversation that ends with an assistant turn, with and without the new messages; the text after the
dummy's last turn-end token is the observation, encoded once. The model's own sampled ids are never decoded and
re-encoded (that is where token drift comes from: a re-encoding merges or splits differently than the sampler
did), and neither is the history: the trajectory is the prompt's ids, the turns' sampled ids and these.

The dummy assistant turn carries reasoning and a tool call, so that templates which render earlier assistant turns
differently from the last one (Qwen3 drops past `<think>` blocks) render it the same way in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_DUMMY_CALL = {"type": "function", "function": {"name": "tool", "arguments": {}}}


class ObservationRenderer:
    def __init__(self, tokenizer: Any, turn_end: Sequence[str] | None = None, **template_kwargs: Any):
        """`tokenizer`: an `asyncrl.models.tokenizer.Tokenizer` with a chat template. `turn_end`: the texts that
        end a model turn in that template (default: the tokenizer's EOS token, e.g. `<|im_end|>`; Llama 3.1 also
        ends tool calls with `<|eom_id|>`). `template_kwargs` go to `apply_chat_template` (e.g. tools=...)."""
        if not tokenizer.has_chat_template:
            raise ValueError("an observation rendered through a chat template needs a tokenizer with one")
        self.tokenizer = tokenizer
        hf = tokenizer.hf
        self.turn_end = list(turn_end) if turn_end else [hf.convert_ids_to_tokens(tokenizer.eos_id)]
        self.kw = template_kwargs

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.hf.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=generation_prompt, **self.kw)

    def text(self, messages: Sequence[dict]) -> str:
        """The observation's text: what the template puts after the model's turn-end token for `messages`."""
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "dummy", "reasoning_content": "dummy", "tool_calls": [_DUMMY_CALL]}]
        before = self._render(dummy, False)
        full = self._render(dummy + list(messages), True)
        ends = [before.rfind(e) + len(e) for e in self.turn_end if e in before]
        if not ends:
            raise ValueError(f"the chat template renders no turn end {self.turn_end} after an assistant turn")
        cut = max(ends)
        if not full.startswith(before[:cut]):
            raise ValueError("the chat template renders earlier turns differently once a message follows them: "
                             "observations cannot be cut from it")
        return full[cut:]

    def ids(self, messages: Sequence[dict]) -> list[int]:
        return self.tokenizer.encode(self.text(messages))

    def after(self, turn_tokens: Sequence[int], messages: Sequence[dict]) -> list[int]:
        """The observation ids to append after a model turn: `ids(messages)`, preceded by the turn-end token when
        the turn did not end with one (it was cut by `max_new_tokens` or ended by a stop string), so the history
        stays what the template would render."""
        end_ids = [self.tokenizer.encode(e) for e in self.turn_end]
        tail = list(turn_tokens)
        closed = any(len(e) and tail[-len(e):] == e for e in end_ids)
        return ([] if closed else end_ids[0]) + self.ids(messages)
