"""Text games from the `textarena` package, played turn by turn in the 'textarena' environment
(`asyncrl/envs/textarena.py`). A sample is a game: an env id and a seed. Its prompt is the game's opening
observation, so every trajectory of a group opens identically; the game, not a verifier, gives the reward.

    prompt  "[GAME] You are Player 0. You are playing Guess The Number. ... Enter your guess."
    turn 0  "[10]"
    obs     "[GAME] The target number is lower."
    ...     until the game ends (the reward is the game's own, for player 0)

textarena is an optional dependency (`pip install textarena==0.7.4`), imported only when a game is opened. Only
single-player games are supported: multi-player ones need opponents this task does not provide. Games that work
offline with 0.7.4 include GuessTheNumber, Mastermind, TowerOfHanoi, Sudoku, Minesweeper, FrozenLake, LightsOut,
Countdown, Cryptarithm, Sokoban, Crosswords and LogicPuzzle; word games (Wordle, Hangman, SpellingBee) fetch nltk
corpora on first use and fail offline.

`Game` (one game, its messages as text) and the prompt/observation formats live here, not in the environment, so
the task's prompts and the environment's observations are one format (and `tasks` imports no `envs`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from asyncrl.tasks.base import Sample, Score, Task, check_split, stable_hash
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.validate import ConfigError, check, check_choice

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

    # The game gives the reward, so the task is played only in its own environment: a source that names another
    # one (`task.sources[i].environment`, set after the task is built) would be graded by `score`, which cannot.
    @property  # type: ignore[override]
    def environment(self) -> str:
        return "textarena"

    @environment.setter
    def environment(self, name: str) -> None:
        if name != "textarena":
            raise ConfigError(f"task.sources[i].environment={name!r} is invalid for a textarena source: must be "
                              "'textarena' or null (the game, not a verifier, gives the reward)")

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
