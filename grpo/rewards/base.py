"""The reward contract: `RewardResult`, the `RewardFunction` base class, and `reward_function`.

A reward is a `RewardFunction`: called with ``(completion, answer)`` it returns a
`RewardResult` (or a ``(reward, success)`` tuple); it has a ``name`` (its column in
``func_names`` and the metrics) and a ``failure_reward`` (given when a call raises, times out
or kills its worker). Write one as a subclass with keyword options, or wrap a plain function
with `reward_function`; see the package docstring.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple


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
        fn (Callable): The scoring function, defined at module level (or a picklable callable
            object).
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
        # Copy the function's name and docstring, but not its __dict__: an attribute of the
        # function must not overwrite this wrapper's name or options.
        functools.update_wrapper(self, fn, updated=())
        # What `inspect.signature` reports is how a config calls this object (keyword options
        # only: `instantiate` and `grpo validate` check a `_component_` node's keys against
        # it), not the scoring call that `__wrapped__` would show.
        del self.__wrapped__
        self.__signature__ = _config_signature(fn)
        super().__init__(name=name, failure_reward=failure_reward)
        self.fn = fn
        self.options = dict(options or {})

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
                f"{_qualified_name(self.fn)} accepts {sorted(option_names)} (score with "
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
        # pickled by reference to itself; store where it lives and look it up on load. A
        # callable object is pickled by value.
        target: Any = self.fn
        if inspect.isfunction(self.fn):
            module, qualname = self.fn.__module__, self.fn.__qualname__
            if "<locals>" in qualname or "<lambda>" in qualname:
                raise pickle.PicklingError(
                    f"reward function {self.name!r} ({module}.{qualname}) is not defined at "
                    "module level, so worker processes cannot import it; move it to module level"
                )
            target = (module, qualname)
        return (_load_function_reward, (target, self.name, self.failure_reward, self.options))

    def __repr__(self) -> str:
        return (
            f"FunctionReward({_qualified_name(self.fn)}, name={self.name!r}, "
            f"failure_reward={self.failure_reward!r}, options={self.options!r})"
        )


def _config_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """Keyword-only ``name``, ``failure_reward`` and the options ``fn`` takes after
    ``(completion, answer)`` (or ``**options`` if it takes any keyword)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        inspect.Parameter("name", keyword, default=None),
        inspect.Parameter("failure_reward", keyword, default=None),
    ]
    for parameter in list(inspect.signature(fn).parameters.values())[2:]:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            parameters.append(parameter)
        elif parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, keyword):
            parameters.append(parameter.replace(kind=keyword))
    return inspect.Signature(parameters)


def _qualified_name(fn: Any) -> str:
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{qualname}"


def _load_function_reward(
    target: Any, name: str, failure_reward: float, options: dict[str, Any]
) -> FunctionReward:
    """Unpickle a :class:`FunctionReward`, importing its function if it was stored by name."""
    if isinstance(target, tuple):
        module, qualname = target
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    fn = target.fn if isinstance(target, FunctionReward) else target
    return FunctionReward(fn, name=name, failure_reward=failure_reward, options=options)


def reward_function(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    failure_reward: float | None = None,
) -> Any:
    """Make a function ``fn(completion, answer, **options)`` a reward function.

    The function returns a :class:`RewardResult` or a ``(reward, success)`` tuple. The
    decorated object scores when called with ``(completion, answer)`` and, called with keyword
    options only, returns a configured copy (how a config's ``_component_`` builds it).
    :func:`~grpo.rewards.batched_rewards` wraps any plain callable it is given this way.

    Args:
        fn (Callable | None): The function (when used as ``@reward_function``).
        name (str | None): Reward name; defaults to the function's ``name`` attribute, else
            its ``__name__``.
        failure_reward (float | None): Reward on exception or timeout; defaults to the
            function's ``failure_reward`` attribute, else 0.

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
        default_name = getattr(function, "__name__", None) or type(function).__name__
        return FunctionReward(
            function,
            name=name or getattr(function, "name", None) or default_name,
            failure_reward=float(
                getattr(function, "failure_reward", 0.0)
                if failure_reward is None
                else failure_reward
            ),
        )

    return wrap if fn is None else wrap(fn)


def reward_name(fn: Any) -> str:
    """The name a reward function scores under: its column in ``func_names`` and the metrics,
    and its key in ``ref.reward_weights`` (a plain callable is wrapped by `reward_function`)."""
    return (fn if isinstance(fn, RewardFunction) else reward_function(fn)).name


def short_error(error: BaseException) -> str:
    """``"TypeName: message"`` of an exception, cut to 500 characters for logs."""
    return f"{type(error).__name__}: {error}"[:500]


def call_reward(reward_fn: RewardFunction, completion: str, answer: str) -> tuple[float, bool]:
    """Call a reward function and check its result.

    Args:
        reward_fn (RewardFunction): The function.
        completion (str): Model output.
        answer (str): Gold answer.

    Returns:
        tuple[float, bool]: ``(reward, success)``.

    Raises:
        TypeError: If the result is not a ``(reward, success)`` pair.
        ValueError: If the reward is not finite (it would poison the group's advantages).
    """
    result = reward_fn(completion, answer)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"reward function {reward_fn.name!r} returned {type(result).__name__}; "
            "expected RewardResult(reward, success) or a (reward, success) tuple"
        )
    reward, success = float(result[0]), bool(result[1])
    if not math.isfinite(reward):
        raise ValueError(f"reward function {reward_fn.name!r} returned reward {reward}")
    return reward, success
