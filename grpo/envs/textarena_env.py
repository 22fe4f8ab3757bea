"""TextArena games as an environment: one single-player game per episode, played turn by turn.

Games are made from TextArena's unwrapped (``-raw``) registrations, so the policy's text goes
to the game as written. TextArena seeds games through Python's global ``random``, so each game
keeps its own random state and its calls are made one at a time.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import operator
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field

from grpo.config.options import checked_options
from grpo.config.sections import REWARD_TIMEOUT_S, RewardTimeout
from grpo.envs.base import Episode, Message, MultiTurnEnv
from grpo.envs.protocol import FailedEpisodes

EXTRA = "hub"
INSTALL_HINT = (
    'grpo.envs.TextArenaEnv needs the textarena package: pip install -e ".[hub]" '
    "(make setup installs it)"
)
# The name the game's reward is logged and weighed under (``ref.reward_weights``).
REWARD_NAME = "textarena"
# TextArena's games draw from the process's global ``random``: one game call at a time.
_RANDOM_LOCK = threading.Lock()


def _textarena() -> Any:
    """The textarena module; ImportError naming the extra that installs it if missing."""
    try:
        import textarena
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return textarena


def game_names() -> list[str]:
    """Every game TextArena registers (its ``-raw`` variants left out), sorted.

    Raises:
        ImportError: If textarena is not installed.
    """
    from_registry = _textarena().envs.registration.ENV_REGISTRY
    return sorted(name for name in from_registry if not name.endswith("-raw"))


def game_problems(game: Any, key: str = "game") -> list[str]:
    """What is wrong with a ``game`` name, in one line naming its key, or nothing.

    The game must exist (the closest name is suggested) and start with one player; ``key`` is
    the option's config key (``environment.game``).
    """
    if not isinstance(game, str) or not game:
        return [f"{key}: expected a TextArena game name such as GuessTheNumber-v0, got {game!r}"]
    try:
        known = game_names()
    except ImportError as error:
        return [f"{key}: {error}"]
    if game not in known:
        close = difflib.get_close_matches(game, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; it has {len(known)} games"
        return [f"{key}: TextArena has no game {game!r}{hint}"]
    try:
        _Game(game, seed=0)
    except Exception as error:  # the game's own refusal, in its words
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        return [f"{key}: {game} does not start as a single-player game here ({message})"]
    return []


class _Game:
    """One TextArena game in play (its ``-raw`` variant when there is one), with its own
    random state."""

    def __init__(self, name: str, seed: int) -> None:
        textarena = _textarena()
        registry = textarena.envs.registration.ENV_REGISTRY
        self.name = name
        self._random: Any = None
        with self._turn():
            self.env = textarena.make(f"{name}-raw" if f"{name}-raw" in registry else name)
            self.env.reset(num_players=1, seed=seed)
        self.done = False
        self.reward = 0.0
        self.info: dict[str, Any] = {}

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """Run a game call on this game's random state, the process's kept aside."""
        with _RANDOM_LOCK:
            outside = random.getstate()
            if self._random is not None:
                random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(outside)

    def observation(self) -> str:
        """What the game says to the player since the last observation (its own actions
        echoed back left out)."""
        with self._turn():
            _, observation = self.env.get_observation()
        if isinstance(observation, str):
            return observation.strip()
        kinds = _textarena().ObservationType
        return "\n".join(
            str(message).strip()
            for _, message, kind in observation
            if kind != kinds.PLAYER_ACTION and str(message).strip()
        )

    def step(self, action: str) -> None:
        """Play ``action``; when the game ends, keep its reward and outcome."""
        with self._turn():
            done, _ = self.env.step(action)
            if done:
                rewards, info = self.env.close()
        if done:
            self.done = True
            self.reward = float((rewards or {}).get(0, 0.0))
            self.info = dict((info or {}).get(0, {}))


class GameRows(Sequence):
    """The rows of one split: row ``i`` is the game played with ``seeds[i]``, its ``question``
    the game's first observation (made when the row is read) and its ``prompt`` the
    template's rendering of it."""

    def __init__(
        self, game: str, seeds: Sequence[int], template: Callable[[str], str], name: str
    ) -> None:
        self.game = game
        self.seeds = seeds
        self.template = template
        self.name = name

    def __len__(self) -> int:
        return len(self.seeds)

    def __getitem__(self, index: Any) -> dict[str, Any]:
        index = operator.index(index)
        seed = int(self.seeds[index])
        question = _Game(self.game, seed).observation()
        return {
            "game": self.game,
            "seed": seed,
            "question": question,
            "answer": "",
            "index": index if index >= 0 else len(self) + index,
            "prompt": self.template(question),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, size={len(self)})"


class ObservationLine:
    """The default prompt: the game's first observation on lines of its own, as the
    environment's later turns are written after a plain prompt."""

    name = "observation_line"
    stop: tuple[str, ...] = ()

    def __call__(self, question: str) -> str:
        return f"{question}\n"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _base_seed(seed: int, game: str) -> int:
    """Where a run's game seeds start, far apart for each (seed, game)."""
    digest = hashlib.sha256(f"{seed}:{game}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF


class TextArenaEnv(MultiTurnEnv):
    """A single-player TextArena game: the policy plays it, the game scores it.

    The environment brings its own rows (run with ``dataset: null``): ``size`` games, each a
    seed, and ``eval_size`` held-out games on other seeds. The game's reward is the reward
    ``textarena`` and its win (reward 1 or more) the success; an unfinished game scores 0.

    Args:
        game (str): A single-player TextArena game (``GuessTheNumber-v0``).
        seed (int): Seed of the games' seeds; the same options give the same games.
        eval_size (int): Held-out games, on seeds no training game has (0: none).
        template (Callable | None): The prompt template; None: the first observation on lines
            of its own (`ObservationLine`).
        stop (Sequence[str]): Strings that end a policy turn (kept in it); by default ``]``,
            since TextArena's actions are bracketed (``[5]``).

    Raises:
        ValueError: An unknown game, one that does not start with one player, a template that
            is not callable, or textarena not installed.
    """

    brings_tasks = True  # the generated rows carry the metadata its scorer reads
    brings_held_out = True  # eval_size rows on other seeds

    @checked_options
    def __init__(
        self,
        game: Annotated[str, Field(min_length=1)],
        size: Annotated[int, Field(ge=1)] = 10000,
        seed: Annotated[int, Field()] = 0,
        eval_size: Annotated[int, Field(ge=0)] = 64,
        template: Callable[[str], str] | None = None,
        reward_functions: Sequence[Any] = (),
        max_turns: Annotated[int, Field(ge=1)] = 12,
        max_episode_tokens: Annotated[int, Field(ge=1)] | None = None,
        max_tokens_per_turn: Annotated[int, Field(ge=1)] | None = None,
        stop: Annotated[Sequence[str], Field()] = ("]",),
        reward_timeout_s: RewardTimeout = REWARD_TIMEOUT_S,
        failed_episodes: Annotated[FailedEpisodes, Field()] = "score",
    ) -> None:
        problems = game_problems(game)
        if problems:
            raise ValueError("; ".join(problems))
        if template is not None and not callable(template):
            raise ValueError(
                "template: expected a template node ({_component_: grpo.data.ChatTemplate, "
                f"model_dir: ...}}) or null (the first observation on its own lines), got "
                f"{template!r}"
            )
        super().__init__(
            reward_functions,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            max_tokens_per_turn=max_tokens_per_turn,
            stop=stop,
            reward_timeout_s=reward_timeout_s,
            failed_episodes=failed_episodes,
        )
        self.game = game
        self.size = size
        self.seed = seed
        self.eval_size = eval_size
        self.template = template if template is not None else ObservationLine()
        # Held-out games first, then the training games: the seeds never overlap.
        start = _base_seed(seed, game)
        self._seeds = {
            "eval": range(start, start + eval_size),
            "train": range(start + eval_size, start + eval_size + size),
        }

    def examples(self) -> Any:
        """The training games (`GameRows`)."""
        return GameRows(self.game, self._seeds["train"], self.template, "textarena:train")

    def eval_examples(self) -> Any:
        """The held-out games (``eval_size`` of them, on seeds no training game has)."""
        return GameRows(self.game, self._seeds["eval"], self.template, "textarena:eval")

    def reset(self, example: Mapping[str, Any]) -> dict[str, Any]:
        """A new game of the example's seed, its first observation read (it is the prompt)."""
        game = _Game(str(example.get("game") or self.game), int(example["seed"]))
        game.observation()
        return {"answer": example.get("answer", ""), "game": game}

    def env_response(
        self, messages: list[Message], state: dict[str, Any], episode: Episode
    ) -> list[Message] | None:
        """Play the policy's turn as the game's action: the game's answer, or None when the
        game is over (its reward and outcome kept in ``state``)."""
        game: _Game = state["game"]
        game.step(messages[-1]["content"])
        if not game.done:
            return [{"role": "user", "content": game.observation()}]
        self._finish(state)
        return None

    def _finish(self, state: dict[str, Any]) -> None:
        """Keep the game's result in ``state`` and let the game object go."""
        game = state.pop("game", None)
        if game is None or "reward" in state:
            return
        invalid = bool(game.info.get("invalid_move", False))
        state["reward"] = game.reward if game.done else 0.0
        state["won"] = game.done and game.reward >= 1.0
        state["reason"] = str(game.info.get("reason", "unfinished"))
        metrics = state.setdefault("metrics", {})
        metrics["textarena_finished"] = float(game.done)
        metrics["textarena_invalid_move"] = float(invalid)

    def reward_names(self) -> list[str] | None:
        """``textarena``, then the reward functions' names."""
        from grpo.rewards import reward_name

        return [REWARD_NAME, *(reward_name(fn) for fn in self.reward_functions)]

    def failure_rewards(self) -> dict[str, float] | None:
        """0 for the game's reward, and each reward function's ``failure_reward``."""
        from grpo.rewards import reward_name

        return {
            REWARD_NAME: 0.0,
            **{
                reward_name(fn): float(getattr(fn, "failure_reward", 0.0))
                for fn in self.reward_functions
            },
        }

    def score(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        """The game's reward (``textarena``) and its win as the success, with the reward
        functions' rewards beside them (scored now, on the episodes' last turns)."""
        return self._score_now(episodes)

    def _score_now(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        if self.reward_functions:
            rewards = super()._score_now(episodes)
        else:
            rewards = [{} for _ in episodes]
            for episode in episodes:
                episode.successes = {}
        scored = []
        for episode, reward in zip(episodes, rewards):
            self._finish(episode.state)  # an episode that stopped before its game did
            episode.successes = {
                REWARD_NAME: float(episode.state["won"]),
                **(episode.successes or {}),
            }
            scored.append({REWARD_NAME: float(episode.state["reward"]), **reward})
        return scored
