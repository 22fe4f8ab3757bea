"""Seeded synthetic arithmetic problems (``What is 37 + 48?`` -> ``"85"``); no files needed.

The train/test split is a hash of the question text alone, so the splits never share a
question whatever seeds or sizes they were generated with.
"""

from __future__ import annotations

import hashlib
import operator
import random
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from grpo.config.options import checked_arguments
from grpo.data.dataset import PromptDataset
from grpo.data.templates import PromptTemplate, resolve_template

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def question_split(question: str, test_fraction: float) -> str:
    """The split a question belongs to: ``"test"`` for a ``test_fraction`` share of questions
    (a stable hash, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(question.encode("utf-8"), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") / 2**64 < test_fraction else "train"


def _parse_weights(name: str, spec: Sequence | Mapping, allowed: Sequence | None) -> dict:
    """``("+", "-")`` -> ``{"+": 1.0, "-": 1.0}``; a mapping is taken as explicit weights."""
    weights = dict(spec) if isinstance(spec, Mapping) else {key: 1.0 for key in spec}
    if not weights:
        raise ValueError(f"{name}: must not be empty")
    for key, weight in weights.items():
        if allowed is not None and key not in allowed:
            raise ValueError(f"{name}: unsupported value {key!r}; expected one of {list(allowed)}")
        if not float(weight) >= 0:
            raise ValueError(f"{name}: weight of {key!r} must be >= 0, got {weight!r}")
    if sum(float(weight) for weight in weights.values()) <= 0:
        raise ValueError(f"{name}: weights must not all be zero, got {weights}")
    return {key: float(weight) for key, weight in weights.items()}


def _digit_intervals(digits: int, min_value: int, max_value: int) -> list[tuple[int, int]]:
    """Closed intervals of the integers in ``[min_value, max_value]`` with ``digits`` digits."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    high = 10**digits - 1
    candidates = [(low, high), (-high, -max(low, 1))]  # non-negative and negative parts
    intervals = []
    for start, end in candidates:
        start, end = max(start, min_value), min(end, max_value)
        if start <= end:
            intervals.append((start, end))
    return intervals


def _sample(rng: random.Random, intervals: list[tuple[int, int]]) -> int:
    """Uniform integer from a union of disjoint closed intervals."""
    offset = rng.randrange(sum(end - start + 1 for start, end in intervals))
    for start, end in intervals:
        if offset <= end - start:
            return start + offset
        offset -= end - start + 1
    raise AssertionError("unreachable: offset beyond the intervals")


def _operand_text(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def arithmetic_problem(
    operations: Sequence[str] | Mapping[str, float] = ("+", "-", "*"),
    min_value: int = 0,
    max_value: int = 99,
    operand_digits: Mapping[int, float] | None = None,
) -> str | None:
    """Why `arithmetic_dataset` would refuse these arguments together, or None.

    Returns:
        str | None: ``key: what is wrong``.
    """
    try:
        _question_space(operations, min_value, max_value, operand_digits)
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def _question_space(
    operations: Sequence[str] | Mapping[str, float],
    min_value: int,
    max_value: int,
    operand_digits: Mapping[int, float] | None,
) -> tuple[dict[str, float], dict[int, tuple[float, list[tuple[int, int]]]]]:
    """The operations' weights, and each digit count's weight and operand intervals.

    Raises:
        ValueError: ``key: what is wrong`` when the arguments leave nothing to draw.
    """
    if min_value > max_value:
        raise ValueError(f"min_value: {min_value} is above max_value ({max_value})")
    operation_weights = _parse_weights("operations", operations, allowed=list(OPERATIONS))

    max_digits = len(str(max(abs(min_value), abs(max_value))))
    if operand_digits is None:
        operand_digits = {digits: 1.0 for digits in range(1, max_digits + 1)}
    digit_weights = {
        int(digits): weight
        for digits, weight in _parse_weights("operand_digits", operand_digits, None).items()
    }
    # Keep only the digit counts that have integers in [min_value, max_value].
    levels = {
        digits: (weight, _digit_intervals(digits, min_value, max_value))
        for digits, weight in digit_weights.items()
        if digits >= 1 and weight > 0 and _digit_intervals(digits, min_value, max_value)
    }
    if not levels:
        raise ValueError(
            f"operand_digits: {dict(operand_digits)} has no digit count with integers in "
            f"[{min_value}, {max_value}]"
        )
    return operation_weights, levels


@checked_arguments
def arithmetic_dataset(
    num_examples: Annotated[int, Field(ge=1)] = 10000,
    seed: int = 0,
    operations: Sequence[str] | Mapping[str, float] = ("+", "-", "*"),
    min_value: Annotated[int, Field()] = 0,
    max_value: Annotated[int, Field()] = 99,
    split: Annotated[Literal["train", "test"], Field()] = "train",
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1,
    operand_digits: Mapping[int, float] | None = None,
    unique: bool = False,
    template: str | Mapping[str, Any] | PromptTemplate | None = None,
) -> PromptDataset:
    """Generate seeded arithmetic problems with integer answers.

    Args:
        seed (int): Seed of the generator; the same arguments always give the same problems.
        operations (Sequence[str] | Mapping[str, float]): Operations (``+``, ``-``, ``*``)
            drawn uniformly, or a mapping from operation to weight.
        min_value (int): Smallest operand (negative ones are written in parentheses).
        split (str): ``"train"`` or ``"test"`` (disjoint).
        test_fraction (float): Share of the question space reserved for ``"test"``, in (0, 1).
        operand_digits (Mapping[int, float] | None): Weight of each digit count, drawn per
            operand. ``None`` weighs every digit count in range equally, so 1-digit operands are
            not drowned by the far more numerous 2-digit ones.
        unique (bool): Never repeat a question. Off by default: a small level (only 100
            single-digit sums) would run dry and shift the mix towards the larger levels.
        template: Prompt template, a name, a ``_component_`` mapping or a callable; defaults
            to ``"answer_only"``.

    Raises:
        ValueError: On an invalid argument, or when ``unique`` is set and the split holds fewer
            than ``num_examples`` distinct questions.
    """
    # Each option's bounds are its annotation's (`checked_arguments`, and `grpo validate`);
    # their relations are `_question_space`'s (`arithmetic_problem`, for `grpo validate`).
    operation_weights, levels = _question_space(operations, min_value, max_value, operand_digits)

    rng = random.Random(seed)
    op_names, op_weights = list(operation_weights), list(operation_weights.values())
    digit_counts = list(levels)
    digit_count_weights = [levels[digits][0] for digits in digit_counts]
    examples: list[dict[str, str]] = []
    seen: set[str] = set()
    # Generous cap so a too-small question space fails loudly instead of looping forever.
    max_draws = 1000 + 50 * num_examples
    draws = 0
    while len(examples) < num_examples:
        if draws >= max_draws:
            raise ValueError(
                f"could only draw {len(examples)} distinct {split!r} questions of the "
                f"{num_examples} asked for after {draws} draws: the question space is too "
                f"small; widen [min_value, max_value], add operations, or set unique=False"
            )
        draws += 1
        op = rng.choices(op_names, op_weights)[0]
        left_digits, right_digits = rng.choices(digit_counts, digit_count_weights, k=2)
        left, right = _sample(rng, levels[left_digits][1]), _sample(rng, levels[right_digits][1])
        question = f"What is {_operand_text(left)} {op} {_operand_text(right)}?"
        if question_split(question, test_fraction) != split:
            continue
        if unique:
            if question in seen:
                continue
            seen.add(question)
        examples.append({"question": question, "answer": str(OPERATIONS[op](left, right))})
    return PromptDataset(
        examples, resolve_template(template, default="answer_only"), name=f"arithmetic[{split}]"
    )
