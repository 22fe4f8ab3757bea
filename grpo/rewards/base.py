"""The reward contract: `RewardResult`, the `RewardFunction` base class, and `reward_function`.

Which functions a config may name is one rule shared with ``grpo validate``
(`grpo.config.reward_forms`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from grpo.config.reward_forms import (
    BATCHED_FILLED,
    COMMON_OPTIONS,
    Form,
    function_parameters,
    option_names,
    option_parameters,
    reward_node_check,
    scoring_form,
)
from grpo.tracebacks import failure_reason

# This package's frames are the machinery that called a reward function, not where it raised.
_REWARDS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class RewardResult(NamedTuple):
    """Outcome of one reward call.

    Args:
        reward (float): The reward.
        success (bool): Whether the completion achieved what the function checks.
    """

    reward: float
    success: bool


RewardFn = Callable[..., "RewardResult | tuple[float, bool] | float | bool"]


class RewardFunction:
    """Base class for reward functions: set ``name``, implement ``__call__``.

    Subclasses take keyword options (a config builds them with ``_component_``) and live at
    module level (worker processes unpickle them).

    Args:
        name (str | None): Overrides the class's default ``name``.
        failure_reward (float | None): Overrides the class's default ``failure_reward``.
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

    def select_columns(self, columns: Mapping[str, Any]) -> dict[str, Any]:
        """The example's columns (but its answer) that ``__call__`` names after
        ``(completion, answer)``, or all of them when it takes ``**kwargs``."""
        return _selected(columns, call_parameters(self.__call__), "per_sample", set())

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{type(self).__name__}({options})"


_PARAMETERS: dict[tuple[Any, bool], tuple[inspect.Parameter, ...]] = {}


def call_parameters(fn: Callable[..., Any]) -> tuple[inspect.Parameter, ...]:
    """The parameters of ``fn``'s signature, computed once per function.

    `select_columns` runs for every completion a reward function scores; ``inspect.signature``
    was most of its time. A bound method's parameters are its function's without the first,
    whatever the instance, so those are kept by function.
    """
    function = getattr(fn, "__func__", fn)
    key = (function, function is not fn)
    try:
        parameters = _PARAMETERS.get(key)
    except TypeError:  # an unhashable callable object
        return tuple(inspect.signature(fn).parameters.values())
    if parameters is None:
        parameters = _PARAMETERS[key] = tuple(inspect.signature(fn).parameters.values())
    return parameters


def _selected(
    columns: Mapping[str, Any],
    parameters: Sequence[inspect.Parameter],
    form: Form,
    configured: set[str],
) -> dict[str, Any]:
    """The columns these parameters take but those a configured option or the call fills."""
    wanted, takes_any = option_parameters(parameters, form)
    filled = set(configured)
    filled |= BATCHED_FILLED if form == "batched" else {p.name for p in list(parameters)[:2]}
    names = {p.name for p in wanted}
    return {
        key: value
        for key, value in columns.items()
        if key not in filled and (takes_any or key in names)
    }


class FunctionReward(RewardFunction):
    """A plain function ``fn(completion, answer, **options)`` used as a reward function.

    Called with ``(completion, answer)`` it scores; called with keyword options only it returns
    a configured copy (what a config's ``_component_`` does). A later parameter is filled by the
    configured ``options`` entry of that name, else by the example's column.
    """

    form: Form = "per_sample"

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
        # The signature a config's keys are checked against (keyword options only), not the
        # scoring call that `__wrapped__` would show.
        del self.__wrapped__
        self.__signature__ = _config_signature(fn, self.form)
        super().__init__(name=name, failure_reward=failure_reward)
        self.fn = fn
        self.options = dict(options or {})

    def __call__(self, *args: Any, **options: Any) -> Any:
        if not args:
            return self.configure(**options)
        return self.fn(*args, **{**self.options, **options})

    def select_columns(self, columns: Mapping[str, Any]) -> dict[str, Any]:
        """The example's columns the function takes but those a configured option sets."""
        return _selected(columns, call_parameters(self.fn), self.form, set(self.options))

    def configure(
        self, *, name: str | None = None, failure_reward: float | None = None, **options: Any
    ) -> FunctionReward:
        """Return a copy with other options, name or failure reward.

        Raises:
            TypeError: If an option is not a keyword parameter of the function.
        """
        parameters = list(inspect.signature(self.fn).parameters.values())
        accepted = option_names(parameters, self.form)
        if accepted is not None and (unknown := sorted(set(options) - accepted)):
            raise TypeError(
                f"reward function {self.name!r}: unknown option(s) {unknown}; "
                f"{_qualified_name(self.fn)} accepts "
                f"{sorted(accepted - set(COMMON_OPTIONS))} (score with fn(completion, answer), "
                "configure with keyword options only)"
            )
        return type(self)(
            self.fn,
            name=self.name if name is None else name,
            failure_reward=self.failure_reward if failure_reward is None else failure_reward,
            options={**self.options, **options},
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # The decorator rebinds the module attribute to this wrapper, so the function cannot be
        # pickled by reference to itself: store where it lives and look it up on load.
        target: Any = self.fn
        if inspect.isfunction(self.fn):
            module, qualname = self.fn.__module__, self.fn.__qualname__
            if "<locals>" in qualname or "<lambda>" in qualname:
                raise pickle.PicklingError(
                    f"reward function {self.name!r} ({module}.{qualname}) is not defined at "
                    "module level, so worker processes cannot import it; move it to module level"
                )
            target = (module, qualname)
        return (
            _load_function_reward,
            (target, self.name, self.failure_reward, self.options, type(self)),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({_qualified_name(self.fn)}, name={self.name!r}, "
            f"failure_reward={self.failure_reward!r}, options={self.options!r})"
        )


class BatchedFunctionReward(FunctionReward):
    """A TRL-style ``fn(completions, prompts=..., **columns) -> list[float]`` as a reward function.

    Each call scores one completion: every argument is a list of one value (``prompts`` holds
    the rendered prompt). A ``None`` reward means the function does not apply (TRL's meaning):
    it scores 0 and is no failure.
    """

    form: Form = "batched"

    def __call__(self, *args: Any, **columns: Any) -> Any:
        if not args:
            return self.configure(**columns)
        completion, answer = args
        parameters = inspect.signature(self.fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        prompt = columns.pop("prompt", None)
        arguments: dict[str, Any] = {key: [value] for key, value in columns.items()}
        if "prompts" in parameters or takes_any:
            arguments["prompts"] = [prompt]
        if "answer" not in self.options and ("answer" in parameters or takes_any):
            arguments["answer"] = [answer]
        result = self.fn(completions=[completion], **arguments, **self.options)
        if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) or len(result) != 1:
            raise TypeError(
                f"batched reward function {self.name!r} returned {_described_value(result)} for "
                "one completion; expected a list of one float per completion"
            )
        [reward] = result
        return RewardResult(0.0, False) if reward is None else reward

    def select_columns(self, columns: Mapping[str, Any]) -> dict[str, Any]:
        """The columns the function takes, and the prompt if it takes ``prompts``."""
        parameters = call_parameters(self.fn)
        selected = _selected(columns, parameters, self.form, set(self.options) | {"prompt"})
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        if "prompt" in columns and (takes_any or any(p.name == "prompts" for p in parameters)):
            selected["prompt"] = columns["prompt"]
        return selected


def _described_value(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _config_signature(fn: Callable[..., Any], form: Form) -> inspect.Signature:
    """The signature a config calls ``fn``'s wrapper with: keyword-only options."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [inspect.Parameter(name, keyword, default=None) for name in COMMON_OPTIONS]
    all_parameters = list(inspect.signature(fn).parameters.values())
    options, takes_any = option_parameters(all_parameters, form)
    # A parameter without a default is optional here: the example's column of its name fills
    # it when the config does not.
    parameters += [
        p.replace(kind=keyword, default=None if p.default is p.empty else p.default)
        for p in options
        if p.name not in COMMON_OPTIONS
    ]
    if takes_any:
        parameters += [p for p in all_parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature(parameters)


def _qualified_name(fn: Any) -> str:
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{qualname}"


def _load_function_reward(
    target: Any,
    name: str,
    failure_reward: float,
    options: dict[str, Any],
    cls: type[FunctionReward] = FunctionReward,
) -> FunctionReward:
    """Unpickle a :class:`FunctionReward`, importing its function if it was stored by name."""
    if isinstance(target, tuple):
        module, qualname = target
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    fn = target.fn if isinstance(target, FunctionReward) else target
    return cls(fn, name=name, failure_reward=failure_reward, options=options)


def reward_function(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    failure_reward: float | None = None,
) -> Any:
    """Make a function a reward function: ``fn(completion, answer, **options)`` per sample, or
    ``fn(completions, **kwargs) -> list[float]`` batched (first parameter ``completions`` or
    ``prompts``), as TRL writes them.

    Args:
        fn (Callable | None): The function (when used as ``@reward_function``).
        name (str | None): Reward name; defaults to the function's ``name`` attribute, else
            its ``__name__``.
        failure_reward (float | None): Reward on exception or timeout; defaults to the
            function's ``failure_reward`` attribute, else 0.

    Returns:
        FunctionReward, or a decorator when called with keyword arguments only.
    """

    def wrap(function: Callable[..., Any]) -> FunctionReward:
        default_name = getattr(function, "__name__", None) or type(function).__name__
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # no signature to read: called as (completion, answer)
            parameters = []
        batched = scoring_form(parameters, decorated=True) == "batched"
        return (BatchedFunctionReward if batched else FunctionReward)(
            function,
            name=name or getattr(function, "name", None) or default_name,
            failure_reward=float(
                getattr(function, "failure_reward", 0.0)
                if failure_reward is None
                else failure_reward
            ),
        )

    return wrap if fn is None else wrap(fn)


def as_reward_function(fn: Any) -> RewardFunction:
    """``fn`` itself if it is a `RewardFunction`; a plain callable wrapped by `reward_function`."""
    return fn if isinstance(fn, RewardFunction) else reward_function(fn)


def reward_name(fn: Any) -> str:
    """The name a reward function scores under (its key in metrics and ``ref.reward_weights``)."""
    return as_reward_function(fn).name


def _configurable(component: Any) -> Any:
    """A plain scoring function as a configurable `FunctionReward`; anything else as it is."""
    parameters = function_parameters(component)
    if parameters is not None and scoring_form(parameters) is not None:
        return reward_function(component)
    return component


def build_reward_function(node: Mapping[str, Any], key: str) -> Any:
    """Build one ``reward_functions`` node, by the rule ``grpo validate`` checks it with.

    The node names a class, a decorated or plain reward function (its keys are options) or a
    factory that takes the keys and returns the reward function.

    Raises:
        InstantiationError: Naming the key: a path that does not import, keys the function
            does not take, or a function that is no reward function (saying what to write).
    """
    from grpo.config import InstantiationError, instantiate, locate

    target = node.get("_component_")
    if isinstance(target, str):
        try:
            component = locate(target)
        except InstantiationError as error:
            raise InstantiationError(f"{key}._component_: {error}") from None
        parameters = function_parameters(component)
        if parameters is not None:
            keys = [name for name in node if name != "_component_"]
            problem, _ = reward_node_check(target, parameters, False, keys)
            if problem is not None:
                raise InstantiationError(f"{key}: {problem}")
    return instantiate(node, _key_=key, _wrap_=_configurable)


def short_error(error: BaseException) -> str:
    """``"TypeName: message"`` of an exception, cut to 500 characters for logs."""
    return f"{type(error).__name__}: {error}"[:500]


def reward_failure_reason(error: BaseException) -> str:
    """The exception and the line of the reward function's own code that raised it."""
    return failure_reason(error, machinery=(_REWARDS_DIR,))


def call_reward(
    reward_fn: RewardFunction,
    completion: str,
    answer: str,
    columns: Mapping[str, Any] | None = None,
) -> tuple[float, bool]:
    """Call a reward function with the example's ``columns`` it takes and check its result.

    Returns:
        tuple[float, bool]: ``(reward, success)``; a float alone succeeds when above 0, a bool
        is 1.0 or 0.0.

    Raises:
        TypeError: If the result is no reward, pair, float or bool.
        ValueError: If the reward is not finite (it would poison the group's advantages).
    """
    result = reward_fn(completion, answer, **columns) if columns else reward_fn(completion, answer)
    if isinstance(result, bool):
        reward, success = float(result), result
    elif isinstance(result, numbers.Real):
        reward = float(result)
        success = reward > 0
    elif isinstance(result, tuple) and len(result) == 2:
        reward, success = float(result[0]), bool(result[1])
    else:
        raise TypeError(
            f"reward function {reward_fn.name!r} returned {_described_value(result)}; return a "
            "float, a bool, a (reward, success) tuple or a RewardResult"
        )
    if not math.isfinite(reward):
        raise ValueError(f"reward function {reward_fn.name!r} returned reward {reward}")
    return reward, success
