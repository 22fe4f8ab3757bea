"""Reward functions, batched scoring with per-sample timeouts, and group advantages.

A reward function is any picklable callable ``fn(completion, answer)`` returning a
:class:`RewardResult` (or a ``(reward, success)`` tuple) with two attributes: ``name`` (the
column name in ``func_names`` and in the metrics) and ``failure_reward`` (the reward given
when the call raises or times out). Write one as a plain function with :func:`reward_function`
or as a subclass of :class:`RewardFunction`; configs build them with ``_component_``::

    reward_fns:
      - _component_: grpo.rewards.MathCorrectnessReward
        partial_credit: 0.1
      - _component_: grpo.rewards.FormatReward
        think_required: false

:func:`batched_rewards` scores every (function, completion) pair. Parsers such as math-verify
can hang on adversarial input, and the caller is usually a Ray actor method running on a
non-main thread, where ``signal.alarm`` timeouts are unavailable. So the calls run in a small
pool of worker processes (:class:`RewardPool`); a call that overruns its timeout gets its
worker killed and replaced, and the sample gets the function's ``failure_reward``. Workers are
forked from a ``forkserver`` that has already imported this module, and start in the
background, so a hung sample costs about ``timeout_s`` and the pool recovers by itself.

:func:`group_advantages` turns the total rewards of one prompt's group into GRPO advantages.
"""

from __future__ import annotations

import atexit
import collections
import functools
import importlib
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_connections
from typing import Any, NamedTuple

import torch
from math_verify import parse as math_verify_parse
from math_verify import verify as math_verify_verify

logger = logging.getLogger(__name__)


class RewardResult(NamedTuple):
    """Outcome of one reward call.

    Args:
        reward (float): The reward.
        success (bool): Whether the completion achieved what the function checks (e.g. the
            answer is correct), logged as a success rate next to the mean reward.
    """

    reward: float
    success: bool


RewardFn = Callable[[str, str], "RewardResult | tuple[float, bool]"]


class RewardFunction:
    """Base class for reward functions: set ``name``, implement ``__call__``.

    Subclasses take their options as keyword arguments so that a config can build them with
    ``_component_``, and must live at module level so worker processes can unpickle them.

    Args:
        name (str | None): Overrides the class's default ``name``.
        failure_reward (float | None): Overrides the class's default ``failure_reward``.

    Example:
        >>> class ShortAnswerReward(RewardFunction):
        ...     name = "short"
        ...     def __init__(self, *, max_chars: int = 200, **kwargs):
        ...         super().__init__(**kwargs)
        ...         self.max_chars = max_chars
        ...     def __call__(self, completion: str, answer: str) -> RewardResult:
        ...         short = len(completion) <= self.max_chars
        ...         return RewardResult(float(short), short)
    """

    name: str = "reward"
    failure_reward: float = 0.0

    def __init__(self, *, name: str | None = None, failure_reward: float | None = None) -> None:
        if name is not None:
            self.name = name
        if failure_reward is not None:
            self.failure_reward = float(failure_reward)

    def __call__(self, completion: str, answer: str) -> RewardResult:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{type(self).__name__}({options})"


class FunctionReward(RewardFunction):
    """A plain function ``fn(completion, answer, **options)`` used as a reward function.

    Made by :func:`reward_function`; see there. Called with ``(completion, answer)`` it scores;
    called with keyword options only it returns a configured copy, which is what a config's
    ``_component_`` does.

    Args:
        fn (Callable): The scoring function, defined at module level.
        name (str): Reward name.
        failure_reward (float): Reward on exception or timeout.
        options (dict | None): Extra keyword arguments passed to ``fn`` on every call.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        failure_reward: float = 0.0,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name=name, failure_reward=failure_reward)
        self.fn = fn
        self.options = dict(options or {})
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **options: Any) -> Any:
        if not args:
            return self.configure(**options)
        return self.fn(*args, **{**self.options, **options})

    def configure(
        self, *, name: str | None = None, failure_reward: float | None = None, **options: Any
    ) -> FunctionReward:
        """Return a copy with other options, name or failure reward.

        Raises:
            TypeError: If an option is not a keyword parameter of the function.
        """
        parameters = list(inspect.signature(self.fn).parameters.values())
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        option_names = {
            p.name
            for p in parameters[2:]
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }
        unknown = sorted(set(options) - option_names)
        if unknown and not takes_any:
            raise TypeError(
                f"reward function {self.name!r}: unknown option(s) {unknown}; "
                f"{self.fn.__qualname__} accepts {sorted(option_names)} (score with "
                f"fn(completion, answer), configure with keyword options only)"
            )
        return FunctionReward(
            self.fn,
            name=self.name if name is None else name,
            failure_reward=self.failure_reward if failure_reward is None else failure_reward,
            options={**self.options, **options},
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # The decorator rebinds the module attribute to this wrapper, so the function cannot be
        # pickled by reference to itself; store where it lives and look it up on load.
        module, qualname = self.fn.__module__, self.fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise pickle.PicklingError(
                f"reward function {self.name!r} ({module}.{qualname}) is not defined at module "
                "level, so worker processes cannot import it; move it to module level"
            )
        return (
            _load_function_reward,
            (module, qualname, self.name, self.failure_reward, self.options),
        )

    def __repr__(self) -> str:
        return (
            f"FunctionReward({self.fn.__module__}.{self.fn.__qualname__}, name={self.name!r}, "
            f"failure_reward={self.failure_reward!r}, options={self.options!r})"
        )


def _load_function_reward(
    module: str, qualname: str, name: str, failure_reward: float, options: dict[str, Any]
) -> FunctionReward:
    """Unpickle a :class:`FunctionReward` by importing its function."""
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    fn = target.fn if isinstance(target, FunctionReward) else target
    return FunctionReward(fn, name=name, failure_reward=failure_reward, options=options)


def reward_function(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    failure_reward: float = 0.0,
) -> Any:
    """Make a module-level function ``fn(completion, answer, **options)`` a reward function.

    The function returns a :class:`RewardResult` or a ``(reward, success)`` tuple. The
    decorated object scores when called with ``(completion, answer)`` and, called with keyword
    options only, returns a configured copy (how a config's ``_component_`` builds it).

    Args:
        fn (Callable | None): The function (when used as ``@reward_function``).
        name (str | None): Reward name; defaults to the function's name.
        failure_reward (float): Reward on exception or timeout.

    Returns:
        FunctionReward, or a decorator when called with keyword arguments only.

    Example:
        >>> @reward_function(name="short")
        ... def short_reward(completion, answer, max_chars=200):
        ...     return float(len(completion) <= max_chars), len(completion) <= max_chars
        >>> short_reward("abc", "1")
        (1.0, True)
        >>> strict_short = short_reward(max_chars=2)  # config: {_component_: mod.short_reward, max_chars: 2}
    """

    def wrap(function: Callable[..., Any]) -> FunctionReward:
        return FunctionReward(
            function, name=name or function.__name__, failure_reward=failure_reward
        )

    return wrap if fn is None else wrap(fn)


def _reward_name(reward_fn: Any) -> str:
    name = getattr(reward_fn, "name", None) or getattr(reward_fn, "__name__", None)
    return str(name or type(reward_fn).__name__)


def _failure_reward(reward_fn: Any) -> float:
    return float(getattr(reward_fn, "failure_reward", 0.0))


def _call_reward(reward_fn: Any, completion: str, answer: str) -> tuple[float, bool]:
    """Call a reward function and check its result.

    Raises:
        TypeError: If the result is not a ``(reward, success)`` pair.
        ValueError: If the reward is not finite (it would poison the group's advantages).
    """
    result = reward_fn(completion, answer)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"reward function {_reward_name(reward_fn)!r} returned {type(result).__name__}; "
            "expected RewardResult(reward, success) or a (reward, success) tuple"
        )
    reward, success = float(result[0]), bool(result[1])
    if not math.isfinite(reward):
        raise ValueError(f"reward function {_reward_name(reward_fn)!r} returned reward {reward}")
    return reward, success


# ---------------------------------------------------------------------------------------------
# Math correctness
# ---------------------------------------------------------------------------------------------

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
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


def extract_answer(completion: str, allow_last_number: bool = True) -> str | None:
    """Find the final answer in a completion.

    Tries, in order: the last non-empty ``<answer>...</answer>``, the last ``\\boxed{...}``,
    and, if allowed, the last number in the text.

    Args:
        completion (str): Model output.
        allow_last_number (bool): Fall back to the last number in the text.

    Returns:
        str | None: The candidate answer, stripped, or None if nothing was found.

    Example:
        >>> extract_answer("<answer>1</answer> no, <answer>2</answer>")
        '2'
    """
    tagged = _ANSWER_TAG_RE.findall(completion)
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
    """Strip a GSM8K-style ``"... #### 72"`` rationale down to ``"72"``.

    Thousands separators and LaTeX are left to math-verify, which reads ``"1,234"`` as 1234.
    """
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def _parse_math(text: str) -> list[Any]:
    """Parse an answer string into math-verify expressions ([] if unparsable).

    LaTeX without delimiters (``\\frac12``, ``10^{3}``) is read as plain text by math-verify
    (``10^{3}`` -> 10), so such strings are wrapped in ``$...$`` first. ``parsing_timeout=None``
    turns off math-verify's ``signal.alarm`` timeout, which fails off the main thread; callers
    bound the time instead (see :func:`batched_rewards`).
    """
    text = text.replace("\\$", "").strip()
    if not text:
        return []
    if "$" not in text and _LATEX_HINT_RE.search(text):
        parsed = math_verify_parse(f"${text}$", fallback_mode="no_fallback", parsing_timeout=None)
        if parsed:
            return parsed
    return math_verify_parse(text, fallback_mode="no_fallback", parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple[Any, ...]:
    # Cached: the samples of a group share one gold answer.
    return tuple(_parse_math(normalize_gold_answer(answer)))


class MathCorrectnessReward(RewardFunction):
    """1.0 if the completion's final answer equals the gold answer according to math-verify.

    The candidate is found by :func:`extract_answer`. Rewards: ``1.0`` correct,
    ``partial_credit`` when a candidate was found and parses as math but is wrong, ``0.0``
    when no candidate was found or it does not parse. ``success`` is correctness.

    Gold answers may be plain (``"72"``, ``"1,234"``, ``"\\frac{1}{2}"``) or GSM8K-style
    (``"... #### 72"``).

    Args:
        partial_credit (float): Reward for a parsable but wrong answer.
        allow_last_number (bool): Fall back to the last number in the text when there is no
            ``<answer>`` tag and no ``\\boxed{}``.
        name (str): Reward name.
        failure_reward (float): Reward on exception or timeout.

    Raises:
        ValueError: When called with a gold answer that math-verify cannot parse (a data
            error; :func:`batched_rewards` counts it and gives ``failure_reward``).

    Example:
        >>> MathCorrectnessReward(partial_credit=0.1)("<answer>85</answer>", "#### 85")
        RewardResult(reward=1.0, success=True)
    """

    name = "math_correctness"

    def __init__(
        self,
        *,
        partial_credit: float = 0.0,
        allow_last_number: bool = True,
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
        predicted = _parse_math(candidate)
        if not predicted:
            return RewardResult(0.0, False)
        if math_verify_verify(list(gold), predicted, timeout_seconds=None):
            return RewardResult(1.0, True)
        return RewardResult(self.partial_credit, False)


# ---------------------------------------------------------------------------------------------
# Format and toy rewards
# ---------------------------------------------------------------------------------------------

# Text containing no <think>, </think>, <answer> or </answer> tag: rejects nested blocks.
_UNTAGGED = r"(?:(?!</?(?:think|answer)>).)*"
_THINK_BLOCK = rf"<think>{_UNTAGGED}</think>\s*"
_ANSWER_BLOCK = rf"<answer>(?P<answer>{_UNTAGGED})</answer>"


class FormatReward(RewardFunction):
    """Reward for the ``<think>...</think><answer>...</answer>`` format.

    A completion has the full format when it is (surrounded by optional whitespace) one think
    block followed by one non-empty answer block, with no tags nested inside either. With
    ``think_required=False`` the think block is optional, so ``<answer>85</answer>`` passes.
    With ``strict=False`` the blocks may be surrounded by other text.

    Rewards: ``format_reward`` for the full format (success), else ``answer_tag_reward`` when
    a non-empty ``<answer>...</answer>`` appears anywhere, else ``0.0``.

    Args:
        think_required (bool): Require the think block.
        strict (bool): Require the blocks to be the whole completion.
        format_reward (float): Reward for the full format.
        answer_tag_reward (float): Partial reward for answer tags alone, e.g. 0.5.
        name (str): Reward name.
        failure_reward (float): Reward on exception or timeout.
    """

    name = "format"

    def __init__(
        self,
        *,
        think_required: bool = True,
        strict: bool = True,
        format_reward: float = 1.0,
        answer_tag_reward: float = 0.0,
        name: str | None = None,
        failure_reward: float = 0.0,
    ) -> None:
        super().__init__(name=name, failure_reward=failure_reward)
        self.think_required = think_required
        self.strict = strict
        self.format_reward = float(format_reward)
        self.answer_tag_reward = float(answer_tag_reward)
        think = _THINK_BLOCK if think_required else f"(?:{_THINK_BLOCK})?"
        pattern = think + _ANSWER_BLOCK
        self._pattern = re.compile(rf"\s*{pattern}\s*" if strict else pattern, re.DOTALL)

    def __call__(self, completion: str, answer: str) -> RewardResult:
        match = (
            self._pattern.fullmatch(completion) if self.strict else self._pattern.search(completion)
        )
        if match is not None and match.group("answer").strip():
            return RewardResult(self.format_reward, True)
        if any(content.strip() for content in _ANSWER_TAG_RE.findall(completion)):
            return RewardResult(self.answer_tag_reward, False)
        return RewardResult(0.0, False)

    def __repr__(self) -> str:
        return (
            f"FormatReward(think_required={self.think_required}, strict={self.strict}, "
            f"format_reward={self.format_reward}, answer_tag_reward={self.answer_tag_reward})"
        )


class TokenPresenceReward(RewardFunction):
    """``reward`` if the completion contains ``token``, else ``absent_reward``.

    A toy reward with an easy learning signal, for tests and smoke runs.

    Args:
        token (str): Substring to look for.
        reward (float): Reward when present.
        absent_reward (float): Reward when absent.
        name (str): Reward name.
        failure_reward (float): Reward on exception or timeout.

    Raises:
        ValueError: If ``token`` is empty.
    """

    name = "token_presence"

    def __init__(
        self,
        *,
        token: str,
        reward: float = 1.0,
        absent_reward: float = 0.0,
        name: str | None = None,
        failure_reward: float = 0.0,
    ) -> None:
        super().__init__(name=name, failure_reward=failure_reward)
        if not token:
            raise ValueError("TokenPresenceReward: token must be a non-empty string")
        self.token = token
        self.reward = float(reward)
        self.absent_reward = float(absent_reward)

    def __call__(self, completion: str, answer: str) -> RewardResult:
        present = self.token in completion
        return RewardResult(self.reward if present else self.absent_reward, present)


# ---------------------------------------------------------------------------------------------
# Batched scoring
# ---------------------------------------------------------------------------------------------


@dataclass
class RewardBatch:
    """Rewards of N completions under F reward functions.

    Args:
        rewards (torch.Tensor): float32, shape ``(N, F)``.
        successes (torch.Tensor): float32 0/1, shape ``(N, F)``.
        func_names (list[str]): Name of each column.
        num_timeouts (dict[str, int]): Calls that overran the timeout, per function.
        num_exceptions (dict[str, int]): Calls that raised (or whose worker died), per function.
    """

    rewards: torch.Tensor
    successes: torch.Tensor
    func_names: list[str]
    num_timeouts: dict[str, int]
    num_exceptions: dict[str, int]

    def total(self, reward_weights: Sequence[float] | None = None) -> torch.Tensor:
        """Total reward per completion, shape ``(N,)``; see :func:`total_reward`."""
        return total_reward(self.rewards, reward_weights)


# One (function, completion) call: (flat index, function index, completion, answer).
_Item = tuple[int, int, str, str]
# Outcome of a call: (reward, success, error kind or None, error message or None).
_Outcome = tuple[float, bool, str | None, str | None]


def _short_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def _exit_when_parent_dies(parent: Any) -> None:
    parent.join()
    os._exit(1)


def _reward_worker_main(conn: Any) -> None:
    """Loop of a reward worker process: receive chunks of calls, stream back one result each.

    Protocol (worker -> parent): ``("ready",)`` once; per chunk ``("loaded",)`` or
    ``("chunk_error", message)``, then ``("result", index, reward, success, error)`` per call
    in chunk order. The parent times each call from the previous message, so importing the
    reward functions' modules does not count against a sample's timeout.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
    parent = multiprocessing.parent_process()
    if parent is not None:  # Do not outlive the parent, even when a call hangs.
        threading.Thread(target=_exit_when_parent_dies, args=(parent,), daemon=True).start()
    # Timeouts are ours; silence math-verify's one-time "timeout is disabled" warning.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    conn.send(("ready",))
    loaded_blob, reward_fns = None, []
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        fns_blob, chunk = message
        if fns_blob != loaded_blob:
            try:
                reward_fns, loaded_blob = pickle.loads(fns_blob), fns_blob
            except Exception as error:
                loaded_blob = None
                conn.send(("chunk_error", f"cannot load reward functions: {_short_error(error)}"))
                continue
        conn.send(("loaded",))
        for index, fn_index, completion, answer in chunk:
            try:
                reward, success = _call_reward(reward_fns[fn_index], completion, answer)
                conn.send(("result", index, reward, success, None))
            except Exception as error:
                conn.send(("result", index, 0.0, False, _short_error(error)))


class _Worker:
    """Parent-side handle of one worker process and the chunk it is working on."""

    def __init__(self, context: Any) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_reward_worker_main, args=(child_conn,), name="grpo-reward-worker", daemon=True
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.chunk: list[_Item] | None = None
        self.loaded = False  # Whether the worker has loaded this chunk's functions.
        self.position = 0  # Index in `chunk` of the call being run.
        self.mark = 0.0  # When the current call (or the load) started, parent clock.

    @property
    def busy(self) -> bool:
        return self.chunk is not None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class RewardPool:
    """Worker processes that run reward calls with a per-call timeout.

    Workers are forked from a ``forkserver`` that has imported this module (and so torch and
    math-verify), so a replacement for a killed worker starts in milliseconds, plus the time
    to re-import the parent's main script, which every spawn or forkserver child does (so a
    script that makes a pool needs the ``if __name__ == "__main__":`` guard). Workers start
    in the background: start-up never counts against a call's timeout. The pool is safe to
    use from any thread; calls are serialised.

    Args:
        num_workers (int | None): Worker processes; defaults to ``min(4, os.cpu_count())``.
        start_method (str | None): ``"forkserver"`` (default where available) or ``"spawn"``.
            Not ``"fork"``: forking a process that runs Ray or torch threads is unsafe.
        startup_timeout_s (float): Limit for a worker to start or to import the reward
            functions' modules.

    Raises:
        ValueError: On a bad ``num_workers`` or ``start_method``.

    Example:
        >>> with RewardPool(num_workers=2) as pool:
        ...     batch = batched_rewards([FormatReward()], ["<answer>1</answer>"], ["1"], pool=pool)
    """

    def __init__(
        self,
        num_workers: int | None = None,
        start_method: str | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if num_workers < 1:
            raise ValueError(f"RewardPool: num_workers must be >= 1, got {num_workers}")
        methods = multiprocessing.get_all_start_methods()
        if start_method is None:
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        if start_method not in ("forkserver", "spawn") or start_method not in methods:
            raise ValueError(
                f"RewardPool: start_method must be 'forkserver' or 'spawn' (available: "
                f"{methods}), got {start_method!r}"
            )
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Import this module (torch, math-verify) once in the server rather than in every
            # worker. Only takes effect if this process has not started its server yet.
            self._context.set_forkserver_preload([__name__])
        self.num_workers = num_workers
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self._workers = [_Worker(self._context) for _ in range(num_workers)]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the workers (killing any that do not exit within a second)."""
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            worker.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def run(
        self, reward_fns: Sequence[Any], items: list[_Item], timeout_s: float
    ) -> list[_Outcome]:
        """Run calls on the workers; one outcome per item, in item order.

        Raises:
            RuntimeError: If the pool is closed or a worker cannot start.
            pickle.PicklingError: If a reward function cannot be pickled.
        """
        if timeout_s <= 0:
            raise ValueError(f"RewardPool.run: timeout_s must be > 0, got {timeout_s}")
        try:
            fns_blob = pickle.dumps(list(reward_fns))
        except Exception as error:
            raise pickle.PicklingError(
                "reward functions must be picklable (module-level classes or functions) to run "
                f"in worker processes: {_short_error(error)}"
            ) from error
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                raise RuntimeError(
                    "RewardPool.run: the pool is closed or belongs to another process"
                )
            try:
                return self._run_locked(fns_blob, items, timeout_s)
            except BaseException:
                # Workers still busy with this call would answer into the next one.
                self._replace_busy_workers()
                raise

    def _replace_busy_workers(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker.busy:
                worker.kill()
                try:
                    self._workers[slot] = _Worker(self._context)
                except Exception:
                    logger.exception("RewardPool: cannot start a worker; closing the pool")
                    self._shutdown()
                    return

    def _run_locked(self, fns_blob: bytes, items: list[_Item], timeout_s: float) -> list[_Outcome]:
        outcomes: list[_Outcome | None] = [None] * len(items)
        position_of = {item[0]: position for position, item in enumerate(items)}
        # Several small chunks per worker balance the load; one message per chunk keeps the
        # per-call overhead low.
        chunk_size = max(1, math.ceil(len(items) / (4 * self.num_workers)))
        pending = collections.deque(
            items[start : start + chunk_size] for start in range(0, len(items), chunk_size)
        )

        def finish(item: _Item, outcome: _Outcome) -> None:
            outcomes[position_of[item[0]]] = outcome

        def replace(slot: int, kind: str | None, message: str) -> None:
            # Start a new worker in place of this one. With a `kind`, charge the call in flight
            # (or, if the worker failed while loading the functions, the whole chunk: it would
            # fail again) and requeue the rest; with None, requeue the whole chunk.
            worker = self._workers[slot]
            if worker.chunk is not None:
                rest = worker.chunk[worker.position :]
                if kind is not None:
                    charged = rest[:1] if worker.loaded else rest
                    for item in charged:
                        finish(item, (0.0, False, kind, message))
                    rest = rest[len(charged) :]
                if rest:
                    pending.appendleft(rest)
            worker.kill()
            self._workers[slot] = _Worker(self._context)

        while pending or any(worker.busy for worker in self._workers):
            for slot, worker in enumerate(self._workers):
                if worker.ready and not worker.busy and pending:
                    chunk = pending.popleft()
                    worker.chunk, worker.position, worker.loaded = chunk, 0, False
                    worker.mark = time.monotonic()
                    try:
                        worker.conn.send((fns_blob, chunk))
                    except OSError:  # Died while idle: nothing of this chunk has run.
                        replace(slot, None, "worker process died")

            deadlines = []
            for worker in self._workers:
                if not worker.ready:
                    deadlines.append(worker.started_at + self.startup_timeout_s)
                elif worker.busy:
                    limit = timeout_s if worker.loaded else self.startup_timeout_s
                    deadlines.append(worker.mark + limit)
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
            slot_of = {id(worker.conn): slot for slot, worker in enumerate(self._workers)}
            watched = [w.conn for w in self._workers if not w.ready or w.busy]
            for conn in wait_for_connections(watched, timeout=timeout):
                self._drain(slot_of[id(conn)], finish, replace)

            now = time.monotonic()
            for slot, worker in enumerate(self._workers):
                if not worker.ready and now - worker.started_at > self.startup_timeout_s:
                    raise RuntimeError(
                        f"RewardPool: a worker did not start within {self.startup_timeout_s} s"
                    )
                if worker.busy and not worker.loaded and now - worker.mark > self.startup_timeout_s:
                    replace(slot, "timeout", "loading the reward functions timed out")
                elif worker.busy and worker.loaded and now - worker.mark > timeout_s:
                    replace(slot, "timeout", f"no result within {timeout_s} s")
        return outcomes  # type: ignore[return-value]

    def _drain(
        self,
        slot: int,
        finish: Callable[[_Item, _Outcome], None],
        replace: Callable[[int, str | None, str], None],
    ) -> None:
        """Read every message a worker has sent."""
        worker = self._workers[slot]
        while True:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=1.0)
                exitcode = worker.process.exitcode
                if not worker.ready:
                    raise RuntimeError(
                        f"RewardPool: a worker exited with code {exitcode} while starting"
                    ) from None
                replace(slot, "exception", f"worker process exited with code {exitcode}")
                return
            kind = message[0]
            if kind == "ready":
                worker.ready = True
            elif kind == "loaded":
                worker.loaded, worker.mark = True, time.monotonic()
            elif kind == "chunk_error":
                for item in worker.chunk[worker.position :]:
                    finish(item, (0.0, False, "exception", message[1]))
                worker.chunk = None
            else:
                _, index, reward, success, error = message
                item = worker.chunk[worker.position]
                assert item[0] == index, f"worker answered item {index}, expected {item[0]}"
                finish(item, (reward, success, "exception" if error else None, error))
                worker.position += 1
                worker.mark = time.monotonic()
                if worker.position == len(worker.chunk):
                    worker.chunk = None


_default_pool: RewardPool | None = None
_default_pool_lock = threading.Lock()


def default_reward_pool() -> RewardPool:
    """The process-wide pool used by :func:`batched_rewards` when none is given.

    Started on first use and closed at interpreter exit.
    """
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None or _default_pool.closed or _default_pool._pid != os.getpid():
            _default_pool = RewardPool()
            atexit.register(_default_pool.close)
        return _default_pool


def batched_rewards(
    reward_fns: Sequence[RewardFn],
    completions: Sequence[str],
    answers: Sequence[str],
    timeout_s: float | None = 5.0,
    pool: RewardPool | None = None,
) -> RewardBatch:
    """Score every completion with every reward function.

    Each (function, completion) call gets ``timeout_s`` seconds in a worker process, timed
    from the worker's previous result; a call that raises, overruns or kills its worker gets
    the function's ``failure_reward`` and success 0, and is counted in the batch. Failures
    are also logged, once per function and batch, with the first error message. Works from
    any thread (no signals).

    Args:
        reward_fns (Sequence): Reward functions with distinct names; module-level (picklable).
        completions (Sequence[str]): N completions.
        answers (Sequence[str]): N gold answers.
        timeout_s (float | None): Per-call limit in seconds. None runs the calls inline in the
            calling thread with no timeout (for debugging; exceptions are still caught).
        pool (RewardPool | None): Pool to use; defaults to :func:`default_reward_pool`.

    Returns:
        RewardBatch: ``rewards`` and ``successes`` of shape ``(N, F)`` (float32) in the order
        of ``reward_fns``, ``func_names``, and per-function timeout and exception counts.

    Raises:
        ValueError: On mismatched lengths, no reward functions or duplicate names.

    Example:
        >>> batch = batched_rewards(
        ...     [MathCorrectnessReward(), FormatReward(think_required=False)],
        ...     ["<answer>85</answer>"], ["85"])
        >>> batch.rewards
        tensor([[1., 1.]])
    """
    if not reward_fns:
        raise ValueError("batched_rewards: reward_fns is empty")
    if len(completions) != len(answers):
        raise ValueError(
            f"batched_rewards: {len(completions)} completions but {len(answers)} answers"
        )
    reward_fns = list(reward_fns)
    func_names = [_reward_name(fn) for fn in reward_fns]
    duplicates = sorted({name for name in func_names if func_names.count(name) > 1})
    if duplicates:
        raise ValueError(f"batched_rewards: duplicate reward function names {duplicates}")

    num_funcs = len(reward_fns)
    items: list[_Item] = [
        (sample * num_funcs + fn_index, fn_index, completion, answer)
        for sample, (completion, answer) in enumerate(zip(completions, answers))
        for fn_index in range(num_funcs)
    ]
    if not items:
        outcomes: list[_Outcome] = []
    elif timeout_s is None:
        outcomes = []
        for _, fn_index, completion, answer in items:
            try:
                reward, success = _call_reward(reward_fns[fn_index], completion, answer)
                outcomes.append((reward, success, None, None))
            except Exception as error:
                logger.debug("reward %s raised", func_names[fn_index], exc_info=True)
                outcomes.append((0.0, False, "exception", _short_error(error)))
    else:
        outcomes = (pool or default_reward_pool()).run(reward_fns, items, timeout_s)

    rewards = torch.zeros(len(completions), num_funcs, dtype=torch.float32)
    successes = torch.zeros(len(completions), num_funcs, dtype=torch.float32)
    num_timeouts = dict.fromkeys(func_names, 0)
    num_exceptions = dict.fromkeys(func_names, 0)
    first_errors: dict[str, str] = {}
    for (index, fn_index, _, _), (reward, success, error_kind, message) in zip(items, outcomes):
        sample, name = index // num_funcs, func_names[fn_index]
        if error_kind is None:
            rewards[sample, fn_index] = reward
            successes[sample, fn_index] = float(success)
            continue
        rewards[sample, fn_index] = _failure_reward(reward_fns[fn_index])
        counter = num_timeouts if error_kind == "timeout" else num_exceptions
        counter[name] += 1
        first_errors.setdefault(name, f"sample {sample}: {message}")
    for name, first_error in first_errors.items():
        logger.warning(
            "reward %r: %d timeout(s), %d exception(s) in a batch of %d; first: %s",
            name,
            num_timeouts[name],
            num_exceptions[name],
            len(completions),
            first_error,
        )
    return RewardBatch(rewards, successes, func_names, num_timeouts, num_exceptions)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def total_reward(
    rewards: torch.Tensor, reward_weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Sum of the per-function rewards, optionally weighted.

    Args:
        rewards (torch.Tensor): Shape ``(N, F)``.
        reward_weights (Sequence[float] | None): F weights; None means all ones.

    Returns:
        torch.Tensor: Shape ``(N,)``.

    Raises:
        ValueError: If the number of weights is not F.
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"total_reward: rewards must have shape (N, F), got {tuple(rewards.shape)}"
        )
    if reward_weights is None:
        return rewards.sum(dim=-1)
    weights = torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (rewards.shape[-1],):
        raise ValueError(
            f"total_reward: {weights.numel()} reward_weights for {rewards.shape[-1]} reward functions"
        )
    return rewards @ weights


def group_advantages(
    rewards: torch.Tensor, eps: float = 1e-4, std_normalize: bool = True
) -> torch.Tensor:
    """GRPO advantages of one group (or of each row of a batch of groups).

    ``(r - mean) / (std + eps)`` with the unbiased (Bessel-corrected, ``torch.std`` default)
    standard deviation of the group, as in DeepSeekMath's GRPO and TRL. ``eps`` (default
    ``1e-4``) only keeps the division finite when the rewards nearly agree; it is added to the
    std, not the variance. A group whose rewards are all equal, or that has one member,
    carries no learning signal and gets exactly zeros. ``std_normalize=False`` gives
    ``r - mean`` (Dr. GRPO).

    Args:
        rewards (torch.Tensor): Total rewards, shape ``(G,)`` or ``(num_groups, G)``.
        eps (float): Added to the std.
        std_normalize (bool): Divide by the std.

    Returns:
        torch.Tensor: float32 advantages, same shape as ``rewards``.

    Raises:
        ValueError: If ``rewards`` is not 1-D or 2-D, or a group is empty.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
        tensor([ 0.8659, -0.8659, -0.8659,  0.8659])
    """
    if rewards.dim() not in (1, 2) or rewards.shape[-1] == 0:
        raise ValueError(
            f"group_advantages: rewards must have shape (G,) or (num_groups, G) with G >= 1, "
            f"got {tuple(rewards.shape)}"
        )
    rewards = rewards.to(torch.float32)
    if rewards.shape[-1] == 1:
        return torch.zeros_like(rewards)
    advantages = rewards - rewards.mean(dim=-1, keepdim=True)
    if std_normalize:
        advantages = advantages / (rewards.std(dim=-1, keepdim=True) + eps)
    # Exact zeros for constant groups: the mean of equal floats can differ from them in the
    # last bit, and with eps=0 their 0/0 would be NaN.
    constant = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    return advantages.masked_fill(constant, 0.0)
