"""Tools that come with the package: a calculator and a Python interpreter.

The Python tool starts a fresh interpreter per call in a new temporary folder, with resource
limits and an audit hook that refuses network access, new processes and writes outside that
folder; its standard output is the answer. The interpreter dies with the worker that started it
(on Linux), so a call stopped at its timeout leaves nothing running.
"""

from __future__ import annotations

import ast
import ctypes
import operator
import os
import signal
import subprocess
import sys
import tempfile

from grpo.process_pool import remove_orphaned_folders

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 64


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 12 * (3 + 4)."""
    try:
        tree = ast.parse(expression.replace("x", "*").replace("^", "**"), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r}") from error
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


# Runs first in the child interpreter: the code comes on stdin, the audit hook (which cannot be
# removed once added) guards everything the code does afterwards.
_PRELUDE = r"""
import os, sys
_root = os.path.realpath(os.getcwd())
_code = sys.stdin.read()
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_DENIED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "os.kill", "pty.spawn", "ctypes.dlopen", "os.startfile")
_PATH_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.symlink",
                "os.link", "os.truncate", "os.utime", "os.chown", "shutil.rmtree")
def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _root or real.startswith(_root + os.sep)
def _guard(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in this tool")
    if event in _DENIED:
        raise PermissionError(f"{event} is disabled in this tool")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writes and path is not None and not _inside(path):
            raise PermissionError(f"writing outside the working folder is disabled: {path}")
    if event in _PATH_EVENTS:
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path):
                raise PermissionError(f"changing files outside the working folder is disabled")
sys.addaudithook(_guard)
exec(compile(_code, "<python tool>", "exec"), {"__name__": "__main__"})
"""


def _limit_resources(memory_mb: int, cpu_s: int) -> None:
    import resource

    memory = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))


# prctl(2) option: the signal a process receives when the thread that forked it exits.
_PR_SET_PDEATHSIG = 1
# A call's folder names the worker that made it: a folder of a worker that is gone was left by
# a call stopped at its timeout (its cleanup never ran).
_FOLDER_PREFIX = "grpo-python-tool-"


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _start_child(libc: ctypes.CDLL | None, worker: int) -> None:
    """In the child, before it runs the interpreter: die with the worker, and limit resources.

    A call past its timeout has its worker stopped (`grpo.envs.runner`); without this the
    interpreter would live on, orphaned, until its own limits end it (a ``sleep`` never does).
    """
    if libc is not None and hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker:  # the worker died before the line above
            os._exit(1)
    _limit_resources(memory_mb=512, cpu_s=10)


def python(code: str) -> str:
    """Run Python code and return what it prints (no network; files only in a temporary folder)."""
    # The folders of calls whose worker was stopped mid-call.
    remove_orphaned_folders(_FOLDER_PREFIX)
    worker, libc = os.getpid(), _libc()
    with tempfile.TemporaryDirectory(prefix=f"{_FOLDER_PREFIX}{worker}-") as folder:
        try:
            completed = subprocess.run(
                [sys.executable, "-I", "-c", _PRELUDE],
                input=code,
                capture_output=True,
                text=True,
                cwd=folder,
                timeout=10,
                env={"PATH": os.environ.get("PATH", ""), "HOME": folder, "TMPDIR": folder},
                preexec_fn=lambda: _start_child(libc, worker),
            )
        except subprocess.TimeoutExpired as error:
            raise TimeoutError("the code ran for more than 10 s") from error
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit code {completed.returncode}")
    return completed.stdout
