"""The keyword arguments of a ``_component_`` path, read from its source without importing it.

Importing the components (torch, torchtune, math-verify) would take seconds. Whatever cannot be
told statically (an inherited ``__init__``, a name assigned at run time, a compiled module,
``from x import *``) is "unknown": the check is skipped, never guessed.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
from pathlib import Path

from grpo.config.errors import InstantiationError
from grpo.config.reward_forms import scoring_form

# How many ``from x import name`` hops to follow before giving up (cycles, deep re-exports).
_MAX_HOPS = 8


class _Unknown(Exception):
    """The source does not tell (the check is skipped)."""


def static_keyword_names(path: str) -> set[str] | None:
    """Keyword arguments the object at a dotted path accepts, read from source.

    Returns:
        set[str] | None: The parameter names; None when it takes ``**kwargs`` or the source
        does not tell.

    Raises:
        InstantiationError: If the module or the attribute certainly does not exist.
    """
    try:
        node = _definition(path)
        return None if node is None else _parameters(node)
    except _Unknown:
        return None


def static_reward_name(path: str) -> str | None:
    """The reward name of the reward function at a dotted path, read from source.

    A `grpo.rewards.RewardFunction` subclass's own ``name = "..."``, the name of a function
    decorated with ``reward_function`` (its ``name=`` argument, else the function's name), or
    that of a plain scoring function (`grpo.config.reward_forms.scoring_form`).

    Returns:
        str | None: The name; None when the source does not tell (inherited, computed) or the
        path does not exist.
    """
    try:
        node = _definition(path)
    except (_Unknown, InstantiationError):
        return None
    if isinstance(node, ast.ClassDef):
        for statement in node.body:
            targets = (
                statement.targets
                if isinstance(statement, ast.Assign)
                else [statement.target]
                if isinstance(statement, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == "name" for t in targets):
                value = statement.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
                return None
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            function = call.func if call is not None else decorator
            if ast.unparse(function).rsplit(".", 1)[-1] != "reward_function":
                continue
            for keyword in call.keywords if call is not None else ():
                if keyword.arg == "name":
                    value = keyword.value
                    is_text = isinstance(value, ast.Constant) and isinstance(value.value, str)
                    return value.value if is_text else None
            return node.name
        # A plain scoring function scores under its own name (`grpo.rewards.reward_function`).
        if not node.decorator_list and scoring_form(_signature_parameters(node.args)):
            return node.name
    return None


def static_function(path: str) -> tuple[list[inspect.Parameter], bool] | None:
    """The parameters of the function at a dotted path, read from source, and whether it is
    decorated with ``reward_function``.

    Returns:
        tuple | None: The parameters (a default stands for any default) and the flag; None for
        a class, a function with other decorators, or when the source does not tell.

    Raises:
        InstantiationError: If the module or the attribute certainly does not exist.
    """
    try:
        node = _definition(path)
    except _Unknown:
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    names = [
        ast.unparse(d.func if isinstance(d, ast.Call) else d).rsplit(".", 1)[-1]
        for d in node.decorator_list
    ]
    if any(name != "reward_function" for name in names):
        return None  # another decorator may make it anything
    return _signature_parameters(node.args), bool(names)


def _signature_parameters(args: ast.arguments) -> list[inspect.Parameter]:
    """`inspect.Parameter`s of a parsed function's arguments (defaults as ``...``)."""
    kind = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    parameters = [
        kind(
            arg.arg,
            kind.POSITIONAL_ONLY if index < len(args.posonlyargs) else kind.POSITIONAL_OR_KEYWORD,
            default=... if index >= first_default else kind.empty,
        )
        for index, arg in enumerate(positional)
    ]
    if args.vararg is not None:
        parameters.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        parameters.append(
            kind(arg.arg, kind.KEYWORD_ONLY, default=kind.empty if default is None else ...)
        )
    if args.kwarg is not None:
        parameters.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return parameters


def static_overrides(path: str, method: str, base: str) -> bool | None:
    """Whether the class at a dotted path defines ``method`` itself rather than inheriting it
    from ``base``, read from source.

    Returns:
        bool | None: True if the class defines it; False if it does not and derives from
        ``base`` directly; None when the source does not tell (a deeper hierarchy, not a
        class).
    """
    try:
        node = _definition(path)
    except (_Unknown, InstantiationError):
        return None
    if not isinstance(node, ast.ClassDef):
        return None
    if any(
        isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == method
        for statement in node.body
    ):
        return True
    if any(ast.unparse(parent).rsplit(".", 1)[-1] == base for parent in node.bases):
        return False
    return None


def _definition(path: str) -> ast.AST | None:
    """The class or function definition at a dotted path; None for a compiled module.

    Raises:
        InstantiationError: If the module or the attribute certainly does not exist.
        _Unknown: If the source does not tell (an attribute of a class, a dynamic module).
    """
    parts = path.split(".")
    if not all(parts):
        raise InstantiationError(f"{path!r} is not a dotted import path")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise InstantiationError(f"cannot import {path!r}: no module named {parts[0]!r}")
    location = _spec_location(spec)
    if location is None:
        return None
    depth = 1
    while depth < len(parts) and location.is_dir():
        child = _submodule(location, parts[depth])
        if child is None:
            break
        location, depth = child, depth + 1
    module_file = location / "__init__.py" if location.is_dir() else location
    if depth == len(parts):
        raise InstantiationError(f"cannot import {path!r}: {path} is a module, not a callable")
    node = _resolve(module_file, parts[depth], ".".join(parts[:depth]), _MAX_HOPS)
    if depth + 1 < len(parts):
        raise _Unknown  # an attribute of a class or object: not followed
    return node


def _spec_location(spec) -> Path | None:
    """A package's folder or a module's ``.py`` file; None for compiled or namespace oddities."""
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        return Path(locations[0]) if len(locations) == 1 else None
    if spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin)
    return None


def _submodule(package: Path, name: str) -> Path | None:
    # A folder without __init__.py is a namespace package: descend; nothing in it is read.
    if (package / name).is_dir():
        return package / name
    if (package / f"{name}.py").is_file():
        return package / f"{name}.py"
    return None


@functools.lru_cache(maxsize=256)
def _parse(module_file: Path) -> ast.Module:
    try:
        return ast.parse(module_file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise _Unknown from exc


def _resolve(module_file: Path, name: str, module_name: str, hops: int) -> ast.AST:
    """The definition of `name` in a module file, following ``from x import name``."""
    if hops <= 0 or not module_file.is_file():
        raise _Unknown
    tree = _parse(module_file)
    dynamic = False
    for statement in tree.body:
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if statement.name == name:
                return statement
            dynamic |= statement.name == "__getattr__"
        elif isinstance(statement, ast.ImportFrom):
            for alias in statement.names:
                if alias.name == "*":
                    dynamic = True
                elif (alias.asname or alias.name) == name:
                    target = _import_target(module_file, statement)
                    if target is None:
                        raise _Unknown
                    source = target / "__init__.py" if target.is_dir() else target
                    sub = _submodule(target, alias.name) if target.is_dir() else None
                    if sub is not None:  # `from pkg import module`: a module, not a callable
                        raise _Unknown
                    return _resolve(source, alias.name, "", hops - 1)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.Import, ast.If, ast.Try)):
            # Assigned, imported as a module, or defined conditionally: exists, shape unknown.
            if _binds(statement, name):
                raise _Unknown
    if dynamic:
        raise _Unknown
    where = module_name or module_file.stem
    close = difflib.get_close_matches(name, _public_names(tree), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise InstantiationError(f"cannot import: module {where} has no {name!r}{hint}")


def _public_names(tree: ast.Module) -> list[str]:
    names = []
    for statement in tree.body:
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(statement.name)
        elif isinstance(statement, ast.ImportFrom):
            names += [alias.asname or alias.name for alias in statement.names]
    return [name for name in names if not name.startswith("_")]


def _binds(statement: ast.stmt, name: str) -> bool:
    for node in ast.walk(statement):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return True
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
    return False


def _import_target(module_file: Path, statement: ast.ImportFrom) -> Path | None:
    """The file or package folder a ``from ... import`` statement reads from."""
    if statement.level:
        base = module_file.parent
        for _ in range(statement.level - 1):
            base = base.parent
        location = base
    else:
        top = (statement.module or "").split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return None
        location = _spec_location(spec) if spec else None
        if location is None:
            return None
        rest = (statement.module or "").split(".")[1:]
        for part in rest:
            child = _submodule(location, part) if location.is_dir() else None
            if child is None:
                return None
            location = child
        return location
    for part in (statement.module or "").split(".") if statement.module else []:
        child = _submodule(location, part) if location.is_dir() else None
        if child is None:
            return None
        location = child
    return location


def _parameters(node: ast.AST) -> set[str] | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _function_parameters(node, skip_first=False)
    if not isinstance(node, ast.ClassDef):
        raise _Unknown
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
            return _function_parameters(statement, skip_first=True)
    is_dataclass = any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)
    if is_dataclass and not node.bases:
        return {
            statement.target.id
            for statement in node.body
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
        }
    if not node.bases and not node.decorator_list:
        return set()  # object.__init__: no arguments
    raise _Unknown  # inherited or generated __init__


def _function_parameters(
    node: ast.FunctionDef | ast.AsyncFunctionDef, skip_first: bool
) -> set[str] | None:
    if node.args.kwarg is not None:
        return None
    keywordable = list(node.args.args)  # positional-only parameters take no keyword
    if skip_first:
        first = [*node.args.posonlyargs, *node.args.args][:1]
        keywordable = [arg for arg in keywordable if arg not in first]
    return {arg.arg for arg in [*keywordable, *node.args.kwonlyargs]}
