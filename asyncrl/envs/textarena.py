"""Text games from the `textarena` package, played turn by turn: the task and its episode
(`TextArenaEnv`), one environment in one place. A sample is a game: an env id and a seed. Its prompt is the game's
opening observation, so every trajectory of a group opens identically; the game, not a verifier, gives the reward.

    prompt  "[GAME] You are Player 0. You are playing Guess The Number. ... Enter your guess."
    turn 0  "[10]"
    obs     "[GAME] The target number is lower."
    ...     until the game ends (the reward is the game's own, for player 0)

textarena is an optional dependency (`pip install textarena==0.7.4`), imported only when a game is opened. Only
single-player games are supported: multi-player ones need opponents this task does not provide. Games that work
offline with 0.7.4 include GuessTheNumber, Mastermind, TowerOfHanoi, Sudoku, Minesweeper, FrozenLake, LightsOut,
Countdown, Cryptarithm, Sokoban, Crosswords and LogicPuzzle; word games (Wordle, Hangman, SpellingBee) fetch nltk
corpora on first use and fail offline.

`Game` (one game, its messages as text) and the prompt/observation formats are shared by the task's prompts and
the episode's observations, so both are one format.

Observations are rendered the way the sample's prompt was: a chat prompt (a list of messages, `task.
prompt_template: chat`) gets each answer as a user message cut from the chat template, token-exact
(`UserTurnRenderer`); a plain prompt gets the game's transcript format ("\\n[GAME] ...\\n[Player] "), so the
trajectory decodes to the game's own transcript. (Not "whenever the tokenizer has a template": the character
tokenizer has one too, and a plain prompt followed by chat-formatted observations would be neither format.)
"""

from __future__ import annotations

import logging
import random
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from asyncrl.envs.chat import ObservationRenderer
from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.rollout import StepResult, Turn
from asyncrl.tasks.base import Sample, Score, Task, check_split, stable_hash
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.validate import ConfigError, check, check_choice

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install textarena==0.7.4"
DEFAULT_ENV_IDS = ("GuessTheNumber-v0",)
PLAYER = 0  # single-player games: the model is always player 0

# textarena's `State.__init__` seeds Python's *global* `random` and games then draw their hidden state from it
# (`random.randint` in GuessTheNumber's reset), so two resets on different threads can interleave and open games
# that do not match their seed. Every reset holds this process-wide lock from the seeding to the last draw.
_RESET_LOCK = threading.Lock()


def import_textarena() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise ImportError(f"the textarena task and environment need the textarena package: {INSTALL_HINT} "
                          f"({e})") from e
    return textarena


class Game:
    """One textarena game for player 0, with its messages rendered as text.

    textarena's default observation wrapper (`LLMObservationWrapper`) re-renders the whole transcript every turn;
    a multi-turn episode needs only what is new, so messages are read from the unwrapped game (`get_observation`
    there returns the messages since the last call and clears them). Actions still go through the full wrapper
    chain, so the game's own action wrappers (e.g. `ActionFormattingWrapper`: "7" -> "[7]") apply as textarena
    intends."""

    def __init__(self, env_id: str, seed: int) -> None:
        ta = import_textarena()
        self.env_id, self.seed = env_id, seed
        self.env = ta.make(env_id=env_id)
        base = self.env
        while isinstance(base, ta.Wrapper):
            base = base.env
        self.base, self._game_id = base, ta.GAME_ID
        with _RESET_LOCK:
            # Restore the process's own global RNG afterwards: textarena's seeding must not reseed other users
            # of `random` in this process (or make their draws repeat across games).
            outer = random.getstate()
            try:
                self.env.reset(num_players=1, seed=seed)
            finally:
                random.setstate(outer)
        if not isinstance(self.base.state, ta.SinglePlayerState):
            raise ValueError(f"textarena game {env_id!r} is not a single-player game (its state is "
                             f"{type(self.base.state).__name__}); only single-player games can be played here")
        self.opening = self._read(skip_own=False)

    @property
    def role(self) -> str:
        """The model's name in the transcript ("Player")."""
        return str(self.base.state.role_mapping.get(PLAYER, f"Player {PLAYER}"))

    def _read(self, skip_own: bool) -> str:
        """The messages the game added since the last read, one `[sender] message` line each (textarena's own
        transcript format); with `skip_own`, without the echo of the model's action (the model's turn is already
        in the trajectory)."""
        ta = import_textarena()
        _, messages = self.base.get_observation()
        lines = []
        for sender, message, kind in messages:
            if skip_own and sender == PLAYER and kind == ta.ObservationType.PLAYER_ACTION:
                continue
            name = "GAME" if sender == self._game_id else self.base.state.role_mapping.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {message}")
        return "\n".join(lines)

    def act(self, action: str) -> tuple[bool, str]:
        """Play `action`: (done, what the game said after it)."""
        done, _ = self.env.step(action=action)
        return bool(done), self._read(skip_own=True)

    def close(self) -> tuple[float | None, dict[str, Any]]:
        """The game's own reward for player 0 (None: the game gave none, it is unfinished) and its end info."""
        rewards, game_info = self.env.close()
        info = dict((game_info or {}).get(PLAYER, {}))
        return (None if rewards is None or PLAYER not in rewards else float(rewards[PLAYER])), info


def plain_prompt(opening: str, role: str, preamble: str = "") -> str:
    """A plain-text prompt: the game's transcript so far, ending with the model's name as the cue to act (the
    observations continue the same transcript, so a trajectory decodes to the game's own transcript)."""
    text = f"{opening}\n[{role}] "
    return f"{preamble}\n\n{text}" if preamble else text


def plain_observation(said: str, role: str) -> str:
    return f"\n{said}\n[{role}] " if said else f"\n[{role}] "


def chat_prompt(opening: str, system_prompt: str = "") -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": opening}]


class TextArenaTask(Task):
    name = "textarena"

    def __init__(self, env_ids: Sequence[str] = DEFAULT_ENV_IDS, eval_size: int = 64, label: str = "textarena",
                 use: str = "both", template: str = "plain", system_prompt: str = "") -> None:
        if not env_ids:
            raise ValueError("env_ids is empty: name at least one textarena game, e.g. ['GuessTheNumber-v0']")
        self.env_ids, self.eval_size, self.label, self.use = tuple(env_ids), eval_size, label, use
        self.template, self.system_prompt = template, system_prompt

    def game_seed(self, split: str, seed: int, index: int) -> int:
        """Train seeds are even and eval seeds odd, so the splits never share a game seed."""
        return 2 * (stable_hash("textarena", self.label, split, seed, index) % (1 << 30)) + (split == "eval")

    def sample(self, split: str, seed: int, index: int) -> Sample:
        env_id = self.env_ids[index % len(self.env_ids)]
        game_seed = self.game_seed(split, seed, index)
        game = Game(env_id, game_seed)
        prompt: Any = chat_prompt(game.opening, self.system_prompt) if self.template == "chat" else \
            plain_prompt(game.opening, game.role, self.system_prompt)
        meta = {"task": self.label, "env_id": env_id, "seed": game_seed, "opening": game.opening}
        return Sample(f"{self.label}/{split}/{index}", prompt, "", meta)

    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        check_split(split)
        if self.use not in ("both", split):
            return
        i = 0
        while split == "train" or i < self.eval_size:
            yield self.sample(split, seed, i)
            i += 1

    def score(self, completion: str, sample: Sample) -> Score:
        raise NotImplementedError(f"{sample.id}: a textarena game is scored by the game itself, in the 'textarena' "
                                  "environment; there is no answer to grade")


def build_textarena(source: TaskSourceConfig, cfg: TaskConfig, where: str) -> TextArenaTask:
    opts = dict(source.options)
    for key in opts:
        check_choice(f"{where}.options", key, ["env_ids", "eval_size", "label"])
    env_ids = opts.get("env_ids", list(DEFAULT_ENV_IDS))
    if isinstance(env_ids, str):
        env_ids = [env_ids]
    env_ids = list(env_ids)
    check(f"{where}.options.env_ids", env_ids, bool(env_ids) and all(isinstance(e, str) and e for e in env_ids),
          "a non-empty list of textarena env ids, e.g. [GuessTheNumber-v0]")
    eval_size = opts.get("eval_size", cfg.eval_size)
    check(f"{where}.options.eval_size", eval_size, isinstance(eval_size, int) and eval_size >= 0, "an int >= 0")
    task = TextArenaTask(env_ids, eval_size=eval_size, label=str(opts.get("label", "textarena")), use=source.split,
                         template=cfg.prompt_template, system_prompt=cfg.system_prompt)
    ta = import_textarena()
    for env_id in env_ids:  # fail at start-up on a game that is unknown, multi-player or broken offline
        if env_id not in ta.envs.registration.ENV_REGISTRY:
            raise ConfigError(f"{where}.options.env_ids: {env_id!r} is not a textarena game "
                              f"(textarena.envs.registration.ENV_REGISTRY)")
        try:
            Game(env_id, 0)
        except Exception as e:  # noqa: BLE001 - any failure of the game's own code, named with the option
            raise ConfigError(f"{where}.options.env_ids: textarena game {env_id!r} cannot be opened as a "
                              f"single-player game: {e!r}") from e
    return task


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
    """The episode: one game, the model as player 0."""

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


ENVIRONMENT = EnvironmentSpec(task=build_textarena, episode=TextArenaEnv)
