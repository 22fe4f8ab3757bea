"""Read the rows of a dataset: a hub name (``datasets.load_dataset``) or a local file.

Rows are numbered from 1 in source order (the line number for ``.jsonl``), so that a skipped row
is reported by a number the user can find; a ``.jsonl`` line that is not JSON is an `InvalidRow`,
skipped rather than failing the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCAL_EXTENSIONS = (".parquet", ".jsonl", ".json")

# Suffixes that mark a source as a file path even when the file is missing, so that a typo in
# a path fails as "file not found" instead of as an unreachable hub dataset.
_FILE_SUFFIXES = (*LOCAL_EXTENSIONS, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip")


@dataclass(frozen=True)
class InvalidRow:
    """Stands in for a row that could not be parsed (a ``.jsonl`` line that is not JSON)."""

    reason: str


@dataclass
class Source:
    """The rows of one dataset source.

    Attributes:
        label (str): What was read, for messages: the path, or ``name[split]`` for the hub.
        is_local (bool): Whether the source is a local file.
        rows (list[tuple[int, Any]]): ``(row number from 1, row)``; a row is a mapping, or an
            `InvalidRow`, or any other value a JSON file held (reported by the caller).
    """

    label: str
    is_local: bool
    rows: list[tuple[int, Any]]


def looks_like_path(source: str) -> bool:
    """A source naming a local file rather than a hub dataset (``owner/name``)."""
    return (
        Path(source).suffix.lower() in _FILE_SUFFIXES
        or source.startswith(("/", "./", "../", "~"))
        or Path(source).expanduser().exists()
    )


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                yield line_number, InvalidRow(f"not valid JSON ({error})")


def _read_json(path: Path) -> Iterator[tuple[int, Any]]:
    """A JSON list of rows, a mapping of columns ``{"question": [...], ...}``, or JSON lines."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # several top-level values: JSON lines in a .json file
            yield from _read_jsonl(path)
            return
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if isinstance(data, Mapping) and all(isinstance(column, list) for column in data.values()):
        names = list(data)
        data = [dict(zip(names, values)) for values in zip(*data.values())]
    if not isinstance(data, list):
        raise ValueError(
            f"{path}: expected a JSON list of rows or a mapping of columns, got {type(data).__name__}"
        )
    yield from enumerate(data, start=1)


def _missing_columns_error(label: str, missing: list[str], available: Sequence[str]) -> ValueError:
    return ValueError(
        f"{label} has no column {', '.join(repr(c) for c in missing)}; "
        f"its columns are {sorted(available)}"
    )


def _read_parquet(path: Path, columns: Sequence[str]) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [column for column in columns if column not in table.column_names]
    if missing:
        raise _missing_columns_error(str(path), missing, table.column_names)
    # Every column: the ones not named ride along in the examples, for environments.
    return list(enumerate(table.to_pylist(), start=1))


def _read_hub(
    name: str, split: str, subset: str | None, columns: Sequence[str], what: str
) -> list[tuple[int, Any]]:
    hint = "pass a local .parquet, .jsonl or .json file as source instead"
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"loading hub dataset {name!r} needs the 'datasets' package (pip install datasets); "
            f"or {hint}"
        ) from error
    try:
        rows = datasets.load_dataset(name, subset, split=split)
    except Exception as error:  # offline, unknown name, unknown split: all end the same way
        raise RuntimeError(
            f"could not load hub dataset {name!r} (subset={subset!r}, split={split!r}): "
            f"{type(error).__name__}: {error}. Without network access (or with "
            f"HF_DATASETS_OFFLINE=1 and nothing cached), {hint}"
        ) from error
    missing = [column for column in columns if column not in rows.column_names]
    if missing:
        raise _missing_columns_error(f"{name}[{split}]", missing, rows.column_names)
    return list(enumerate(rows, start=1))


def open_source(
    source: str | os.PathLike,
    columns: Sequence[str],
    split: str = "train",
    subset: str | None = None,
    what: str = "dataset",
) -> Source:
    """Read every row of a hub dataset or a local file, checking that the columns exist.

    Args:
        source (str | os.PathLike): A hub name or a local ``.parquet`` / ``.jsonl`` / ``.json``
            file. A string is a path when it has a file suffix, starts with ``/``, ``./``,
            ``../`` or ``~``, or names an existing file.
        columns (Sequence[str]): Columns the caller needs: all of them in a parquet file or hub
            dataset, each in at least one row of JSON. The rows hold every column.
        split, subset: Hub split and configuration name; ignored for a local file.
        what (str): What is being loaded, for messages (``"GSM8K"``).

    Raises:
        FileNotFoundError: If ``source`` looks like a path and no such file exists.
        ValueError: On an unsupported extension, a file that is not valid JSON as a whole, or
            a column that the source lacks.
        ImportError: If a hub name is given and ``datasets`` is not installed.
        RuntimeError: If the hub dataset cannot be loaded (e.g. offline).
    """
    source = os.fspath(source)
    if not looks_like_path(source):
        rows = _read_hub(source, split, subset, columns, what)
        return Source(f"{source}[{split}]", False, rows)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{what} file not found: {source!r} (resolved to {path.resolve()})")
    if not path.is_file():
        raise ValueError(
            f"{what} source {source!r} is not a file; expected one of {LOCAL_EXTENSIONS}"
        )
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return Source(source, True, _read_parquet(path, columns))
    if suffix not in (".jsonl", ".json"):
        raise ValueError(
            f"unsupported {what} file extension {suffix!r} for {source!r}; "
            f"expected one of {LOCAL_EXTENSIONS}"
        )
    rows = list(_read_jsonl(path) if suffix == ".jsonl" else _read_json(path))
    seen: set[str] = set()
    for _, row in rows:
        if isinstance(row, Mapping):
            seen.update(row)
    missing = [column for column in columns if column not in seen]
    if missing and seen:  # a file with no object rows at all is reported row by row instead
        raise _missing_columns_error(source, missing, seen)
    return Source(source, True, rows)
