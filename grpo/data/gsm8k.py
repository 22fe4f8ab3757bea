"""GSM8K from the dataset hub or from a local ``.parquet`` / ``.jsonl`` / ``.json`` file.

Rows have GSM8K's columns: ``question`` and ``answer``, where ``answer`` is a worked solution
ending in ``#### 72``. The final number is extracted (commas removed) as the gold answer. Rows
that cannot be used are skipped and counted in the dataset's ``skipped`` report rather than
failing a long run at load time; a file with no usable row at all is an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from grpo.data.dataset import PromptDataset, SkipReport
from grpo.data.templates import PromptTemplate, resolve_template

LOCAL_EXTENSIONS = (".parquet", ".jsonl", ".json")
_FINAL_ANSWER = re.compile(r"####\s*([-+]?\$?\s*[\d,]*\.?\d+)")


def extract_gsm8k_answer(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, without commas or ``$``.

    Args:
        solution (str): GSM8K ``answer`` text, e.g. ``"... so she earns 1,234.\\n#### 1,234"``.

    Returns:
        str | None: The final answer (``"1234"``), or ``None`` when there is no ``#### <number>``.

    Example:
        >>> extract_gsm8k_answer("She has 3 + 4 = 7 apples.\\n#### 7")
        '7'
    """
    matches = _FINAL_ANSWER.findall(solution)
    if not matches:
        return None
    number = re.sub(r"[\s,$]", "", matches[-1])
    return number.lstrip("+")


def _row_problem(row: Any) -> tuple[dict[str, str] | None, str]:
    """Validate one raw row; return ``(example, "")`` or ``(None, reason)``."""
    if not isinstance(row, Mapping):
        return None, f"not an object with 'question' and 'answer' ({type(row).__name__})"
    example = {}
    for key in ("question", "answer"):
        value = row.get(key)
        if value is None:
            return None, f"missing {key}"
        if not isinstance(value, str):
            return None, f"{key} is not a string ({type(value).__name__})"
        if not value.strip():
            return None, f"empty {key}"
        example[key] = value.strip()
    final = extract_gsm8k_answer(example["answer"])
    if final is None:
        return None, "answer has no '#### <number>' final answer"
    return {"question": example["question"], "answer": final}, ""


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed object)``; unparsable lines yield an error string marker."""
    with path.open(encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                yield line_number, _InvalidJson(str(error))


class _InvalidJson:
    """Stands in for a ``.jsonl`` line that is not valid JSON, so it is skipped and counted."""

    def __init__(self, message: str) -> None:
        self.message = message


def _read_json(path: Path) -> Iterator[tuple[int, Any]]:
    """A JSON list of rows, a column mapping ``{"question": [...], "answer": [...]}``, or JSON lines."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # several top-level values: JSON lines in a .json file
            yield from _read_jsonl(path)
            return
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if isinstance(data, Mapping) and all(isinstance(column, list) for column in data.values()):
        columns = list(data)
        data = [dict(zip(columns, values)) for values in zip(*data.values())]
    if not isinstance(data, list):
        raise ValueError(
            f"{path}: expected a JSON list of rows or a mapping of columns, got {type(data).__name__}"
        )
    yield from enumerate(data, start=1)


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [column for column in ("question", "answer") if column not in table.column_names]
    if missing:
        raise ValueError(
            f"{path} has no column(s) {missing}; expected GSM8K columns 'question' and 'answer', "
            f"found {table.column_names}"
        )
    yield from enumerate(table.select(["question", "answer"]).to_pylist(), start=1)


def _read_hub(source: str, split: str, config: str | None) -> Iterator[tuple[int, Any]]:
    hint = "pass a local .parquet, .jsonl or .json file as source instead"
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"loading hub dataset {source!r} needs the 'datasets' package (pip install datasets); "
            f"or {hint}"
        ) from error
    try:
        rows = datasets.load_dataset(source, config, split=split)
    except Exception as error:  # offline, unknown name, unknown split: all end the same way
        raise RuntimeError(
            f"could not load hub dataset {source!r} (config={config!r}, split={split!r}): "
            f"{type(error).__name__}: {error}. Without network access (or with "
            f"HF_DATASETS_OFFLINE=1 and nothing cached), {hint}"
        ) from error
    yield from enumerate(rows, start=1)


# Suffixes that mark a source as a file path even when the file is missing, so that a typo in
# a path fails as "file not found" instead of as an unreachable hub dataset.
_FILE_SUFFIXES = (*LOCAL_EXTENSIONS, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip")


def _looks_like_path(source: str) -> bool:
    """A source naming a local file rather than a hub dataset (``owner/name``)."""
    return (
        Path(source).suffix.lower() in _FILE_SUFFIXES
        or source.startswith(("/", "./", "../", "~"))
        or Path(source).expanduser().exists()
    )


def _rows(source: str, split: str, config: str | None) -> Iterable[tuple[int, Any]]:
    if not _looks_like_path(source):
        return _read_hub(source, split, config)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"GSM8K file not found: {source!r} (resolved to {path.resolve()})")
    if not path.is_file():
        raise ValueError(
            f"GSM8K source {source!r} is not a file; expected one of {LOCAL_EXTENSIONS}"
        )
    readers = {".parquet": _read_parquet, ".jsonl": _read_jsonl, ".json": _read_json}
    suffix = path.suffix.lower()
    if suffix not in readers:
        raise ValueError(
            f"unsupported GSM8K file extension {suffix!r} for {source!r}; "
            f"expected one of {LOCAL_EXTENSIONS}"
        )
    return readers[suffix](path)


def gsm8k_dataset(
    source: str | os.PathLike = "openai/gsm8k",
    split: str = "train",
    config: str | None = "main",
    template: str | Mapping[str, Any] | PromptTemplate | None = None,
    max_skipped_examples: int = 5,
) -> PromptDataset:
    """Load GSM8K problems with their final numeric answers.

    Args:
        source (str | os.PathLike): A hub dataset name (``"openai/gsm8k"``, loaded with
            ``datasets.load_dataset``) or a local ``.parquet`` / ``.jsonl`` / ``.json`` file
            with columns ``question`` and ``answer``.
        split (str): Hub split to load; ignored for a local file (the file is the split).
        config (str | None): Hub configuration name (``"main"`` or ``"socratic"``); ignored for
            a local file.
        template: Prompt template, a name, a ``_component_`` mapping or a callable; defaults to
            ``"think_answer"``.
        max_skipped_examples (int): How many skipped rows the report keeps, with their reasons.

    Returns:
        PromptDataset: Examples ``{"question": ..., "answer": "72"}``. Its ``skipped`` report
        counts rows that were missing a field, empty, or had no ``#### <number>`` answer;
        rows are numbered from 1 (the line number for ``.jsonl``).

    Raises:
        FileNotFoundError: If ``source`` looks like a path and no such file exists.
        ValueError: On an unsupported extension, a file lacking the GSM8K columns, or a source
            with no usable row.
        ImportError: If a hub name is given and ``datasets`` is not installed.
        RuntimeError: If the hub dataset cannot be loaded (e.g. offline).

    Example:
        >>> train = gsm8k_dataset("data/gsm8k_train.jsonl")
        >>> if train.skipped.count:
        ...     print(train.skipped.summary())
    """
    source = os.fspath(source)
    is_local = _looks_like_path(source)
    label = source if is_local else f"{source}[{split}]"
    skipped = SkipReport(label, max_examples=max_skipped_examples)
    examples, rows = [], []
    for row_number, row in _rows(source, split, config):
        if isinstance(row, _InvalidJson):
            skipped.add(row_number, f"not valid JSON ({row.message})")
            continue
        example, reason = _row_problem(row)
        if example is None:
            skipped.add(row_number, reason)
            continue
        examples.append(example)
        rows.append(row_number)
    if not examples:
        raise ValueError(f"no usable GSM8K rows in {label}; {skipped.summary()}")
    return PromptDataset(
        examples,
        resolve_template(template, default="think_answer"),
        name=f"gsm8k:{label}",
        rows=rows,
        skipped=skipped,
    )
