"""Prose against code: docstring and comment-only lines over the other non-blank lines.

Every line of every docstring (module, class, function) and every line that holds only a
comment counts as prose; every other non-blank line is code. Run it on a package folder::

    python scripts/prose_ratio.py grpo
    python scripts/prose_ratio.py grpo --top 20   # and the files with the most prose per code

It also counts the functions whose docstring has more lines than their body.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers (1-based) every docstring of ``tree`` spans."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def comment_lines(source: str) -> set[int]:
    """The line numbers holding only a comment."""
    lines: set[int] = set()
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    return lines - code_lines


def long_docstrings(tree: ast.AST) -> int:
    """Functions whose docstring has more lines than the rest of their body."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) > 1:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    doc = first.end_lineno - first.lineno + 1
                    body = node.body[-1].end_lineno - node.body[1].lineno + 1
                    count += doc > body
    return count


def file_counts(path: Path) -> tuple[int, int, int]:
    """``(prose lines, code lines, functions with a docstring longer than their body)``."""
    source = path.read_text()
    tree = ast.parse(source)
    # Every line of a docstring is prose, its blank lines too; a blank line elsewhere is nothing.
    prose = docstring_lines(tree) | comment_lines(source)
    non_blank = {n for n, line in enumerate(source.splitlines(), 1) if line.strip()}
    return len(prose), len(non_blank - prose), long_docstrings(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, nargs="?", default=Path("grpo"))
    parser.add_argument("--top", type=int, default=0, help="also list the N wordiest files")
    args = parser.parse_args()
    rows = [(path, *file_counts(path)) for path in sorted(args.folder.rglob("*.py"))]
    prose = sum(row[1] for row in rows)
    code = sum(row[2] for row in rows)
    long = sum(row[3] for row in rows)
    print(f"{args.folder}: {len(rows)} files, {prose} prose lines, {code} code lines")
    print(f"prose ratio: {prose / max(code, 1):.2f}")
    print(f"functions with a docstring longer than their body: {long}")
    if args.top:
        rows.sort(key=lambda row: row[1] / max(row[2], 1), reverse=True)
        for path, file_prose, file_code, _ in rows[: args.top]:
            print(
                f"  {file_prose / max(file_code, 1):5.2f}  {file_prose:5d} / {file_code:5d}  {path}"
            )


if __name__ == "__main__":
    main()
