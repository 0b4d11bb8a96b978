"""`Environments` opens, for each prompt, one episode per sample of its group, as the sample's source says: its
environment's own episode (`EnvironmentSpec.episode`), a single turn graded by the task's verifier, or, for a
source with `tools: true`, turns that call the run's tools until the model answers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from asyncrl.envs.registry import Source, source_of
from asyncrl.envs.single_turn import SingleTurnEnv
from asyncrl.envs.tool_use import Toolbox, ToolEnv
from asyncrl.tools.config import ToolsConfig


class Environments:
    """Opens the episodes of a run's prompts: `open(sample, n) -> (prompt ids, n episodes)`."""

    def __init__(self, sources: Sequence[Source], tokenizer: Any, verifier: Any, *, chat: bool,
                 step_timeout_s: float, tools: ToolsConfig | None = None):
        self.sources, self.tokenizer, self.verifier, self.chat = list(sources), tokenizer, verifier, chat
        self.step_timeout_s = step_timeout_s
        self.tools_cfg = tools or ToolsConfig()
        self._toolbox: Toolbox | None = None
        self._toolbox_lock = threading.Lock()  # `open` runs on every replica's thread

    @property
    def toolbox(self) -> Toolbox:
        """Built on first use, only for runs whose tasks use tools (its sandbox pool starts on the first call)."""
        with self._toolbox_lock:
            if self._toolbox is None:
                self._toolbox = Toolbox(self.tools_cfg, self.tokenizer, self.chat)
            return self._toolbox

    def close(self) -> None:
        if self._toolbox is not None:
            self._toolbox.close()

    def stop_sequences(self) -> list[tuple[int, ...]]:
        """The stop sequences of every source's episodes (its spec's `stop`, texts encoded with the run's tokenizer,
        or ids; the tool format's for a source with tools): the engine's decode program compiles them in and ends
        any row's turn on one, so they are the union over the run."""
        seqs = set()
        for src in self.sources:
            for q in self.toolbox.format.stop if src.tools else src.spec.stop:
                ids = self.tokenizer.encode(q) if isinstance(q, str) else [int(t) for t in q]
                if ids:
                    seqs.add(tuple(ids))
        return sorted(seqs)

    def open(self, sample: Any, n: int) -> tuple[list[int], list[Any]]:
        src = source_of(self.sources, sample)
        t = self.step_timeout_s
        if src.tools:  # the prompt offers the tools: rendered once per group
            ids = self.toolbox.prompt_ids(sample.prompt)
            envs = [ToolEnv(ids, sample, self.verifier, t, self.tokenizer, toolbox=self.toolbox) for _ in range(n)]
        else:
            ids = self.tokenizer.encode_prompt(sample.prompt, chat=self.chat)
            episode = src.spec.episode
            envs = [SingleTurnEnv(ids, sample, self.verifier, t) if episode is None else
                    episode(ids, sample, self.verifier, t, self.tokenizer) for _ in range(n)]
        opened = [env.reset() for env in envs]
        if any(list(o) != list(opened[0]) for o in opened[1:]):
            raise ValueError(f"the environments of {sample.id} open differently; a group's samples must share "
                             "their prompt")
        return list(opened[0]), envs
