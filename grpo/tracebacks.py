"""Why user code failed, in one line: the exception and where in the user's own code it raised.

Environments and reward functions run user code inside the framework's machinery; when it
raises, what helps is the exception and the user's own lines, not the frames around them.
Imports nothing of the framework.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence

# Frames of the user's code a reason names: where it raised, and what called that.
_FRAMES_SHOWN = 2
# A reason longer than this, or of several lines, leads with its last line (see `cause_first`).
_LONG_REASON = 200
# A formatted traceback's frame: '  File "/x/env.py", line 12, in env_response' and its code.
_TRACEBACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def exception_name(error: BaseException) -> str:
    """``KeyError`` for a built-in exception, ``module.Class`` for any other."""
    cls = type(error)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _described(error: BaseException) -> str:
    message = str(error)
    return f"{exception_name(error)}: {message}" if message else exception_name(error)


def frame_text(filename: str, line: int | str, name: str, code: str | None) -> str:
    """``/x/env.py:12 in env_response: return state["x"]`` (without the code if unknown)."""
    where = f"{filename}:{line} in {name}"
    return f"{where}: {code.strip()}" if code and code.strip() else where


def failure_reason(error: BaseException, machinery: Sequence[str] = ()) -> str:
    """Why user code failed: the exception and where in the user's code it raised.

    The frames named are the innermost ones outside ``machinery`` (folders ending in the path
    separator, or files); an exception raised in the machinery itself names its last frame. The
    exception it was raised from, if any, follows.

    Returns:
        str: e.g. ``KeyError: 'anwser' (at /home/me/my_env.py:31 in env_response:
        return state["anwser"])``.
    """
    frames = traceback.extract_tb(error.__traceback__)
    prefixes = tuple(machinery)
    own = [frame for frame in frames if not (prefixes and frame.filename.startswith(prefixes))]
    shown = (own or frames)[-_FRAMES_SHOWN:]
    where = ", called from ".join(
        frame_text(f.filename, f.lineno or 0, f.name, f.line) for f in reversed(shown)
    )
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return cause_first(
        _described(error),
        name=exception_name(error),
        where=where or None,
        then=f"raised from {_described(cause).splitlines()[0]}" if cause is not None else None,
    )


def cause_first(
    text: str, name: str | None = None, where: str | None = None, then: str | None = None
) -> str:
    """A reason kept whole, its cause first: a long or multi-line text leads with its last line.

    A traceback states its cause last; a summary that showed the head of the text would show
    everything but the cause.

    Args:
        where (str | None): Where it raised (``"/x/env.py:12 in env_response: ..."``).
        then (str | None): More to say on the first line (the exception it came from).

    Returns:
        str: ``text`` with ``where`` and ``then`` if it is short and on one line; else its
        last line with them, then the whole text on the lines after.
    """
    text = text.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    long = len(lines) > 1 or len(text) > _LONG_REASON
    head = text
    if long and lines:
        head = (
            lines[-1] if name is None or lines[-1].startswith(name) else f"{name}: ... {lines[-1]}"
        )
    if where:
        head = f"{head} (at {where})"
    if then:
        head = f"{head}; {then}"
    return f"{head}\n{text}" if long else head


def last_frame(traceback_text: str) -> str | None:
    """The innermost frame of a formatted traceback (a verifiers error's), named as in
    `failure_reason`; None if it has none."""
    lines = traceback_text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = _TRACEBACK_FRAME.match(lines[index])
        if match:
            following = lines[index + 1] if index + 1 < len(lines) else ""
            # The frame's code line is indented under it (absent when the source was not found).
            code = following if following.startswith("    ") else None
            return frame_text(match["file"], match["line"], match["name"], code)
    return None
