"""reasoning-gym tasks as an environment: its procedural tasks, scored by its own scorers.

reasoning-gym (the ``hub`` extra) is imported only when a task is checked, generated or scored.
"""

from __future__ import annotations

import difflib
import hashlib
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field

from grpo.config.options import checked_options
from grpo.config.sections import REWARD_TIMEOUT_S, RewardTimeout
from grpo.envs.base import Episode
from grpo.envs.single_turn import SingleTurnEnv

EXTRA = "hub"
INSTALL_HINT = (
    'grpo.envs.ReasoningGymEnv needs the reasoning-gym package: pip install -e ".[hub]" '
    "(make setup installs it)"
)
# The scorer, `grpo.rewards.reasoning_gym.ReasoningGymReward`, is imported when an environment
# is built: importing this module loads no torch.
REWARD_NAME = "reasoning_gym"


def _reasoning_gym() -> Any:
    """The reasoning_gym module.

    Raises:
        ImportError: If it is not installed, naming the extra that installs it.
    """
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted.

    Raises:
        ImportError: If reasoning-gym is not installed.
    """
    _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _weight_and_config(spec: Any) -> tuple[float, dict[str, Any]]:
    """A task's sampling weight and reasoning-gym config from its ``tasks`` value (checked)."""
    if isinstance(spec, Mapping):
        return float(spec.get("weight", 1.0)), dict(spec.get("config") or {})
    return float(spec), {}


def _spec_problem(spec: Any) -> str | None:
    """What is wrong with the form of one ``tasks`` value, or None."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | Mapping):
        return f"expected a weight > 0 or {{weight, config}}, got {spec!r}"
    if not isinstance(spec, Mapping):
        return None if spec > 0 else f"expected a weight > 0, got {spec!r}"
    unknown = sorted(set(spec) - {"weight", "config"})
    if unknown:
        return f"unknown key(s) {unknown}; a task takes weight and config"
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        return f"weight: expected a number > 0, got {weight!r}"
    config = spec.get("config")
    if config is not None and not isinstance(config, Mapping):
        return f"config: expected a mapping of the task's options, got {config!r}"
    return None


def task_problems(tasks: Any, key: str = "tasks") -> list[str]:
    """What is wrong with a ``tasks`` mapping, one line per task, each naming its key.

    Every name must be a task (the closest one is suggested), every weight above 0, and every
    task's config must build its dataset; ``key`` is the option's config key.
    """
    if not isinstance(tasks, Mapping) or not tasks:
        return [f"{key}: expected a mapping of reasoning-gym task names to weights, got {tasks!r}"]
    try:
        known = task_names()
    except ImportError as error:
        return [f"{key}: {error}"]
    from reasoning_gym import create_dataset

    problems = []
    for name, spec in tasks.items():
        where = f"{key}.{name}"
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; it has {len(known)} tasks"
            problems.append(f"{where}: reasoning-gym has no task {name!r}{hint}")
            continue
        if (problem := _spec_problem(spec)) is not None:
            problems.append(f"{where}: {problem}")
            continue
        _, config = _weight_and_config(spec)
        try:
            create_dataset(name, size=1, seed=0, **config)
        except Exception as error:  # the task's own check of its config, in its words
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            problems.append(f"{where}.config: {message}")
    return problems


def _seed(seed: int, task: str, split: str) -> int:
    """A task's generator seed for a split: far apart for each (seed, task, split), since
    reasoning-gym seeds row i with ``seed + i``."""
    digest = hashlib.sha256(f"{seed}:{task}:{split}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _counts(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """``total`` split over the tasks in proportion to their weights (largest remainders)."""
    norm = sum(weights.values())
    exact = {name: total * weight / norm for name, weight in weights.items()}
    counts = {name: int(share) for name, share in exact.items()}
    for name in sorted(exact, key=lambda n: counts[n] - exact[n])[: total - sum(counts.values())]:
        counts[name] += 1
    return counts


class QuestionLine:
    """The default prompt: the question on a line of its own (as
    ``grpo.data.AnswerOnlyTemplate`` writes it), the answer closed by ``</answer>``."""

    name = "question_line"
    stop: tuple[str, ...] = ("</answer>",)

    def __call__(self, question: str) -> str:
        return f"{question}\n"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TaskRows(Sequence):
    """Generated rows with the prompt template attached: ``rows[i]`` also carries the
    ``prompt`` the template renders from its question, as for a `grpo.data.PromptDataset`."""

    def __init__(self, rows: list[dict[str, Any]], template: Callable[[str], str], name: str):
        self.rows = rows
        self.template = template
        self.name = name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: Any) -> dict[str, Any]:
        row = self.rows[operator.index(index)]
        return {**row, "prompt": self.template(row["question"])}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, size={len(self)})"


def _rows(
    task: str,
    config: Mapping[str, Any],
    count: int,
    seed: int,
    avoid: set[str],
) -> list[dict[str, Any]]:
    """``count`` rows of one task, none whose question is in ``avoid``.

    Raises:
        ValueError: If the task's config has too few distinct questions to fill ``count``
            rows that avoid the others.
    """
    from reasoning_gym import create_dataset

    size = max(count, 1)
    for _ in range(5):
        rows = []
        dataset = create_dataset(task, size=size, seed=seed, **config)
        for entry in dataset:
            if entry["question"] in avoid:
                continue
            rows.append(entry)
            if len(rows) == count:
                return rows
        size *= 2
    raise ValueError(
        f"tasks.{task}: {len(rows)} of {count} training questions differ from the held-out "
        "ones; the task's config has too few distinct questions (widen it, or lower eval_size)"
    )


class ReasoningGymEnv(SingleTurnEnv):
    """reasoning-gym tasks: one response per question, scored by the task's own scorer.

    The environment brings its own rows (run with ``dataset: null``): ``size`` questions drawn
    from ``tasks`` by weight, and ``eval_size`` held-out ones from other seeds, none of them a
    training question. Each response is scored by `ReasoningGymReward` (``reasoning_gym``).

    Args:
        tasks (Mapping): Task name -> sampling weight, or -> ``{weight, config}`` where
            ``config`` holds the task's reasoning-gym options (``{min_terms: 2}``).
        template (Callable | None): The prompt template; None: the question on a line of its
            own (`QuestionLine`).

    Raises:
        ValueError: An unknown task, a weight that is not above 0, a task config its task
            refuses, a template that is not callable, or reasoning-gym not installed.
    """

    brings_tasks = True  # the generated rows carry the metadata its scorer reads
    brings_held_out = True  # eval_size rows on other seeds

    @checked_options
    def __init__(
        self,
        tasks: Annotated[Mapping[str, Any], Field(min_length=1)],
        size: Annotated[int, Field(ge=1)] = 20000,
        seed: Annotated[int, Field()] = 0,
        eval_size: Annotated[int, Field(ge=0)] = 512,
        template: Callable[[str], str] | None = None,
        reward_functions: Sequence[Any] = (),
        reward_timeout_s: RewardTimeout = REWARD_TIMEOUT_S,
    ) -> None:
        problems = task_problems(tasks)
        if problems:
            raise ValueError("; ".join(problems))
        if template is not None and not callable(template):
            raise ValueError(
                "template: expected a template node ({_component_: grpo.data.ChatTemplate, "
                f"model_dir: ...}}) or null (the question on a line of its own), got {template!r}"
            )
        self.tasks = {name: _weight_and_config(spec) for name, spec in tasks.items()}
        from grpo.rewards.reasoning_gym import ReasoningGymReward

        scorer = ReasoningGymReward(config={name: c for name, (_, c) in self.tasks.items() if c})
        super().__init__([scorer, *reward_functions], reward_timeout_s=reward_timeout_s)
        self.size = size
        self.seed = seed
        self.eval_size = eval_size
        self.template = template if template is not None else QuestionLine()
        self._splits: dict[str, Any] = {}

    def examples(self) -> Any:
        """The training rows with the template (`TaskRows`; made once)."""
        return self._split("train")

    def eval_examples(self) -> Any:
        """The held-out rows (``eval_size`` of them, from other seeds, none a training
        question), with the same template and columns (`TaskRows`)."""
        return self._split("eval")

    def _split(self, split: str) -> Any:
        if split not in self._splits:
            self._splits = self._generate()
        return self._splits[split]

    def _generate(self) -> dict[str, Any]:
        """Both splits: the held-out rows first, so the training rows can avoid them."""
        weights = {name: weight for name, (weight, _) in self.tasks.items()}
        splits = {}
        held_out: dict[str, set[str]] = {}
        for split, total in (("eval", self.eval_size), ("train", self.size)):
            rows = []
            for task, count in _counts(weights, total).items():
                config = self.tasks[task][1]
                if count == 0:
                    continue
                avoid = held_out.get(task, set()) if split == "train" else set()
                entries = _rows(task, config, count, _seed(self.seed, task, split), avoid)
                if split == "eval":
                    held_out[task] = {entry["question"] for entry in entries}
                rows += [
                    {
                        "question": str(entry["question"]),
                        "answer": str(entry["answer"]),
                        "task": task,
                        "metadata": entry.get("metadata", {}),
                    }
                    for entry in entries
                ]
            # Tasks interleaved, in an order fixed by the seed.
            random.Random(_seed(self.seed, "order", split)).shuffle(rows)
            for index, row in enumerate(rows):
                row["index"] = index
            splits[split] = TaskRows(rows, self.template, name=f"reasoning_gym:{split}")
        return splits

    def _score_now(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        """Rewards by name, and each episode's task score as its ``<task>_reward`` metric."""
        rewards = super()._score_now(episodes)
        for episode, reward in zip(episodes, rewards):
            task = episode.example.get("task")
            if task is not None:
                metrics = episode.state.setdefault("metrics", {})
                metrics[f"{task}_reward"] = reward[REWARD_NAME]
        return rewards
