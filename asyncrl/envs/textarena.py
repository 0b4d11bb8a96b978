"""The environment of the textarena task (`asyncrl/tasks/textarena.py`): one textarena game per episode, the model
as player 0. Each model turn is the game's action; the game's answer is the next observation, and when the game
ends its own reward for player 0 is the episode's.

Observations are rendered the way the sample's prompt was: a chat prompt (a list of messages, `task.
prompt_template: chat`) gets each answer as a user message cut from the chat template, token-exact
(`UserTurnRenderer`); a plain prompt gets the game's transcript format ("\\n[GAME] ...\\n[Player] "), so the
trajectory decodes to the game's own transcript. (Not "whenever the tokenizer has a template": the character
tokenizer has one too, and a plain prompt followed by chat-formatted observations would be neither format.)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from asyncrl.envs.chat import ObservationRenderer
from asyncrl.rollout import StepResult, Turn
from asyncrl.tasks.textarena import Game, plain_observation

log = logging.getLogger(__name__)

# A reasoning model's thinking is not its move: the game reads only what follows it (an unclosed block, a turn cut
# while thinking, holds no move at all). Games search the action for their pattern (GuessTheNumber: the first
# "[n]"), so a number weighed while thinking would otherwise be played.
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)


class UserTurnRenderer(ObservationRenderer):
    """`ObservationRenderer` for a user message after the model's turn. Its base cuts the observation from a dummy
    conversation rendered with and without the new messages, and requires the history to render the same in both;
    with a *user* message that cannot hold for templates that re-render earlier assistant turns once a new query
    comes (Qwen3 drops their `<think>` blocks, and shows an empty one only on the last turn). The observation is
    still well defined: what the template puts after the assistant turn's end token, read from the one rendering
    that has the new message. The trajectory keeps the model's sampled ids for its own turns, as always."""

    def text(self, messages: Sequence[dict]) -> str:
        user = [{"role": "user", "content": "dummy"}]
        head = self._render(user, True)  # everything up to the dummy assistant turn's content
        full = self._render(user + [{"role": "assistant", "content": "dummy"}] + list(messages), True)
        if not full.startswith(head) or not full[len(head):].startswith("dummy"):
            raise ValueError("the chat template renders a user turn differently once an assistant turn follows "
                             "it: observations cannot be cut from it")
        rest = full[len(head) + len("dummy"):]
        ends = [rest.find(e) + len(e) for e in self.turn_end if e in rest]
        if not ends:
            raise ValueError(f"the chat template renders no turn end {self.turn_end} after an assistant turn")
        return rest[min(ends):]


def action_text(text: str) -> str:
    return _THINK.sub("", text).strip()


def episode_reward(game_reward: float | None) -> float:
    """The game's reward for player 0, in [0, 1]. textarena's single-player games score 1 for a solved game and the
    share completed (in [0, 1]) otherwise; the exceptions are the -1 of `SinglePlayerState.set_invalid_move`'s
    default (a game lost to invalid moves, e.g. Bandit) and a count above 1 (Set scores the sets found): clipped
    to 0 and 1. An unfinished game (the engine's turn or context limit came first) gave no reward: 0."""
    return 0.0 if game_reward is None else min(max(float(game_reward), 0.0), 1.0)


class TextArenaEnv:
    stop: tuple[tuple[int, ...], ...] = ()

    def __init__(self, prompt_ids: Sequence[int], sample: Any, verifier: Any, timeout_s: float, tokenizer: Any):
        for key in ("env_id", "seed"):
            if key not in sample.metadata:
                raise ValueError(f"sample {sample.id} has no metadata[{key!r}]: the 'textarena' environment plays "
                                 "samples of the textarena task")
        self.prompt_ids, self.sample, self.tokenizer = list(prompt_ids), sample, tokenizer
        self.env_id, self.seed = str(sample.metadata["env_id"]), int(sample.metadata["seed"])
        self.chat = isinstance(sample.prompt, list)
        self.renderer = UserTurnRenderer(tokenizer) if self.chat else None
        self.game: Game | None = None

    def reset(self) -> list[int]:
        self.game = Game(self.env_id, self.seed)
        opening = self.sample.metadata.get("opening")
        if opening is not None and self.game.opening != opening:
            raise ValueError(f"textarena game {self.env_id!r} with seed {self.seed} opens differently from its "
                             f"sample {self.sample.id}: the game's reset is not determined by its seed")
        return list(self.prompt_ids)

    def step(self, turn: Turn) -> StepResult:
        if self.game is None:
            raise RuntimeError(f"TextArenaEnv.step before reset ({self.sample.id})")
        info: dict[str, Any] = {"game": self.env_id, "seed": self.seed}
        try:
            done, said = self.game.act(action_text(turn.text))
            if not done and not turn.last:
                return StepResult(self._observation(turn.tokens, said), 0.0, False)
            game_reward, end = self.game.close()
        except Exception as e:  # noqa: BLE001 - a game's failure ends its episode, never the run
            log.warning("textarena game %s (seed %d, sample %s) failed at turn %d: %r", self.env_id, self.seed,
                        self.sample.id, turn.index, e)
            return StepResult(None, 0.0, True, "env_error", {**info, "error": repr(e)})
        reason = end.get("reason") or ("unfinished" if game_reward is None else "done")
        info.update(game_reward=game_reward, invalid_move=bool(end.get("invalid_move", False)),
                    turn_count=end.get("turn_count"))
        return StepResult(None, episode_reward(game_reward), True, str(reason), info)

    def _observation(self, turn_tokens: Sequence[int], said: str) -> list[int]:
        if self.renderer is not None:
            return self.renderer.after(turn_tokens, [{"role": "user", "content": said}])
        assert self.game is not None
        return self.tokenizer.encode(plain_observation(said, self.game.role))
