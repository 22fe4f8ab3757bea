"""The one protocol between the collector and every kind of episode.

The collector knows nothing of what an episode is: every kind of episode (single-turn,
multi-turn, tools, verifiers, agents) implements `Environment`, and the limits of an episode
are the framework's (`EpisodeLimits`). Pure Python; no torch, Ray or vLLM (``grpo validate``
reads environments).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from grpo.envs.base import Episode
    from grpo.envs.rollout import TurnEngine

# One prompt of a batch: the example, and its prompt token ids (`Environment.prompt_ids`).
Prompt = tuple[dict[str, Any], list[int]]
# What becomes of an episode the environment failed (`Environment.failed_episodes`).
FailedEpisodes = Literal["drop", "score"]


@dataclass(frozen=True)
class EngineContext:
    """What an environment is told once, before its first episode, about the engine.

    Args:
        tokenizer: The model folder's tokenizer (`grpo.models.load_tokenizer`).
        max_model_len (int): The engine's context: prompt and response never exceed it.
        max_tokens_per_turn (int): ``inference.max_generated_tokens``.
    """

    model_dir: str
    tokenizer: Any
    max_model_len: int
    max_tokens_per_turn: int
    temperature: float = 1.0
    top_p: float = 1.0
    prompt_template: Any = None

    @property
    def add_bos(self) -> bool:
        """Whether prompts start with a bos token: a chat template's text already holds the
        model's leading special tokens (Llama 3's writes <|begin_of_text|>)."""
        return bool(getattr(self.prompt_template, "add_bos", True))


@dataclass(frozen=True)
class EpisodeLimits:
    """Where an episode stops, whatever its kind.

    Args:
        max_turns (int): Most policy turns; an episode that reaches it ends (``hit_max_turns``
            when the environment would have gone on).
        max_episode_tokens (int | None): Most response tokens (policy and environment) of an
            episode; None: the context is the only bound.
    """

    max_turns: int
    max_tokens_per_turn: int
    max_model_len: int
    max_episode_tokens: int | None = None

    def room(self, prompt_len: int, response_len: int) -> int:
        """Response tokens an episode with these lengths may still add."""
        room = self.max_model_len - prompt_len - response_len
        if self.max_episode_tokens is not None:
            room = min(room, self.max_episode_tokens - response_len)
        return room

    def turn_tokens(self, prompt_len: int, response_len: int, asked: int | None = None) -> int:
        """Tokens the next policy turn may sample (0: none fit).

        Args:
            prompt_len (int): The episode's prompt tokens.
            response_len (int): Its response tokens so far.
            asked (int | None): What the turn's caller asked for (a client's ``max_tokens``).
        """
        limit = self.max_tokens_per_turn if asked is None else min(asked, self.max_tokens_per_turn)
        return max(min(limit, self.room(prompt_len, response_len)), 0)


class Environment(ABC):
    """What the collector calls to turn prompts into scored episodes.

    A subclass writes `run_groups` and `score`; the rest has defaults. The collector calls
    `examples`, `response_budget` and `start` once (and `start_scoring`, on a thread of its
    own, while its engine builds), then per batch `prompt_ids`, `run_groups`, `score`,
    `batch_metrics` and `take_reward_calls`, and `close` at the end.
    """

    # Set by `start`; a class attribute, so that subclasses need not call a base __init__.
    context: EngineContext | None = None
    # What becomes of an episode the environment failed: "drop" leaves it out of its group;
    # "score" keeps it there, scored with `failure_rewards`.
    failed_episodes: FailedEpisodes = "drop"

    # What the run's config gives beside it, which `grpo validate` checks before any actor
    # starts (`grpo.envs.preflight.data_problems`). A subclass inherits its base's answers.
    # Brings its own tasks (`examples`): the run's ``dataset`` is null, since a dataset's rows
    # would lack the task data its scorer reads.
    brings_tasks: ClassVar[bool] = False
    # Brings its own held-out rows (`eval_examples`, as many as its ``eval_size`` option):
    # evaluation needs no ``eval_dataset``.
    brings_held_out: ClassVar[bool] = False
    # Its episodes are scored by the run's ``reward_functions``; False: they come back scored
    # (an agent's own reward, a taskset's rubric), and the list may be empty.
    scored_by_reward_functions: ClassVar[bool] = True

    def examples(self) -> list[dict[str, Any]] | None:
        """The rows the run samples from when it names no ``dataset`` (a taskset's), or None."""
        return None

    def eval_examples(self) -> Any:
        """The held-out rows evaluation plays when the run names no ``eval_dataset`` (an
        environment that generates its own tasks, kept apart from `examples`), or None."""
        return None

    def response_budget(self, max_tokens_per_turn: int) -> int | None:
        """The most response tokens of one episode, which the engine's context must hold; None:
        only the context bounds it."""
        return max_tokens_per_turn

    def start(self, context: EngineContext) -> None:
        """Learn what the engine is; called once before the first episode."""
        self.context = context

    def start_scoring(self) -> None:  # noqa: B027 (optional: most score in-process)
        """Start what `score` runs on (worker processes), so the first batch's scores wait
        for none of it. Called at most once, maybe while `start` runs on another thread."""

    def prompt_ids(self, example: Mapping[str, Any]) -> list[int]:
        """The token ids of an example's rendered ``prompt``.

        Raises:
            KeyError: If the example has no ``prompt`` (a dataset built without a template).
        """
        context = self._started()
        text = example.get("prompt")
        if text is None:
            raise KeyError(
                f"example {example.get('index')} has no 'prompt' (build the dataset with a "
                "template)"
            )
        # A chat template's text already holds its special tokens: encoded as it is, as
        # transformers and vLLM encode it.
        return context.tokenizer.encode(text, add_bos=context.add_bos, add_eos=False)

    @abstractmethod
    def run_groups(
        self,
        prompts: Sequence[Prompt],
        engine: TurnEngine,
        group_size: int,
        seeds: Sequence[int],
    ) -> list[list[Episode]]:
        """Run ``group_size`` episodes per prompt to their end on ``engine``.

        Args:
            engine (TurnEngine): The collector's engine; a turn joins its running batch.

        Returns:
            list[list[Episode]]: Per prompt, its finished episodes (a failed one has ``error``).
        """

    @abstractmethod
    def score(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        """Rewards of finished episodes (none has ``error``: failed ones are scored apart,
        `failure_rewards`), by reward name, in order."""

    def reward_names(self) -> list[str] | None:
        """The names `score` gives its rewards, known before any episode runs, or None."""
        return None

    def failure_rewards(self) -> dict[str, float] | None:
        """Rewards of an episode the environment failed and ``failed_episodes: score`` keeps
        in its group, by reward name; None: 0 under each name `score` gives the others."""
        return None

    def take_reward_calls(self) -> dict[str, dict[str, Any]] | None:
        """Its reward functions' calls since it was last asked (`RewardCalls.as_dict`), by
        reward name; None: it scores without reward functions of the run's."""
        return None

    def batch_metrics(self) -> dict[str, float]:
        """Metrics of the last `run_groups` of this environment's own (``inference/...``)."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional: most environments open nothing)
        """Release what `start` opened (servers, worker processes)."""

    def _started(self) -> EngineContext:
        if self.context is None:
            raise RuntimeError(f"{type(self).__name__}.start must be called before episodes run")
        return self.context
