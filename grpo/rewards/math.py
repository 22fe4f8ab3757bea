"""Math correctness: find the final answer in a completion and compare it with math-verify
(its ``signal.alarm`` timeouts off: it runs off the main thread, in timed worker processes)."""

from __future__ import annotations

import functools
import re
from typing import Any

from math_verify import parse as math_verify_parse
from math_verify import verify as math_verify_verify

from grpo.rewards.base import RewardFunction, RewardResult

# The content of every <answer>...</answer> block (also used by FormatReward).
ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number with optional sign, thousands separators and decimals. The minus sign must not
# follow a word character, so "pages 3-5" ends in "5", not "-5".
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?\d+(?:,\d{3})*(?:\.\d+)?")
_LATEX_HINT_RE = re.compile(r"[\\^{]")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:index]
    return None


def extract_answer(completion: str, allow_last_number: bool = False) -> str | None:
    """Find the final answer in a completion: the last non-empty ``<answer>...</answer>``, else
    the last ``\\boxed{...}``, else (if ``allow_last_number``) the last number.

    Returns:
        str | None: The candidate answer, stripped, or None if nothing was found.
    """
    tagged = ANSWER_TAG_RE.findall(completion)
    if tagged and tagged[-1].strip():
        return tagged[-1].strip()
    boxed = _last_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if allow_last_number:
        numbers = _NUMBER_RE.findall(completion)
        if numbers:
            return numbers[-1]
    return None


def normalize_gold_answer(answer: str) -> str:
    """Strip a GSM8K-style ``"... #### 72"`` rationale down to ``"72"``."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def _parse_math(text: str) -> list[Any]:
    """Parse an answer string into math-verify expressions ([] if unparsable)."""
    text = text.replace("\\$", "").strip()
    if not text:
        return []
    # math-verify reads LaTeX without delimiters as plain text (``10^{3}`` -> 10).
    if "$" not in text and _LATEX_HINT_RE.search(text):
        parsed = math_verify_parse(f"${text}$", fallback_mode="no_fallback", parsing_timeout=None)
        if parsed:
            return parsed
    return math_verify_parse(text, fallback_mode="no_fallback", parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple[Any, ...]:
    # Cached: the samples of a group share one gold answer.
    return tuple(_parse_math(normalize_gold_answer(answer)))


@functools.lru_cache(maxsize=16384)
def _parse_candidate(candidate: str) -> tuple[Any, ...]:
    # Cached: parsing is nearly all of a call's time (about 0.2 ms, against 0.01 ms for the
    # comparison), and the samples of a group, and the questions of a dataset, reach the same
    # answers again and again. The parsed expressions are immutable sympy objects.
    return tuple(_parse_math(candidate))


class MathCorrectnessReward(RewardFunction):
    """1.0 if the completion's final answer (:func:`extract_answer`) equals the gold answer
    according to math-verify; ``partial_credit`` if it parses but is wrong; else 0.0.

    Args:
        allow_last_number (bool): Fall back to the last number in the text. Off by default:
            paying for a number that ends an unformatted response teaches the policy to drop
            the format; turn it on only for data without a format.

    Raises:
        ValueError: When called with a gold answer that math-verify cannot parse.
    """

    name = "math_correctness"

    def __init__(
        self,
        *,
        partial_credit: float = 0.0,
        allow_last_number: bool = False,
        name: str | None = None,
        failure_reward: float = 0.0,
    ) -> None:
        super().__init__(name=name, failure_reward=failure_reward)
        self.partial_credit = float(partial_credit)
        self.allow_last_number = allow_last_number

    def __call__(self, completion: str, answer: str) -> RewardResult:
        gold = _parse_gold(answer)
        if not gold:
            raise ValueError(f"{self.name}: math-verify could not parse the gold answer {answer!r}")
        candidate = extract_answer(completion, allow_last_number=self.allow_last_number)
        if candidate is None:
            return RewardResult(0.0, False)
        predicted = _parse_candidate(candidate)
        if not predicted:
            return RewardResult(0.0, False)
        if math_verify_verify(list(gold), list(predicted), timeout_seconds=None):
            return RewardResult(1.0, True)
        return RewardResult(self.partial_credit, False)
