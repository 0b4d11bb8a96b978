"""Turn a bare problem into the prompt the policy sees: plain text, or chat messages with a system prompt."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.tasks.base import Prompt
from asyncrl.tasks.config import DEFAULT_INSTRUCTION, TaskConfig


@dataclass(frozen=True)
class PromptFormat:
    """How problems are wrapped; every task in a mixture shares one, so the policy sees one format."""

    template: str = "plain"
    system_prompt: str = ""
    instruction: str = DEFAULT_INSTRUCTION

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> PromptFormat:
        return cls(cfg.prompt_template, cfg.system_prompt, cfg.instruction)

    def render(self, problem: str) -> Prompt:
        user = f"{problem.strip()}\n\n{self.instruction}" if self.instruction else problem.strip()
        if self.template == "chat":
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return messages + [{"role": "user", "content": user}]
        if self.template == "plain":
            return f"{self.system_prompt}\n\n{user}" if self.system_prompt else user
        raise ValueError(f"task.prompt_template={self.template!r} is invalid: must be one of ['plain', 'chat']")
