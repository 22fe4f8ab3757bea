"""What the benchmark scripts share: the machine's load and a plain-text table.

The scripts run as ``python scripts/NAME.py``, so this folder is on ``sys.path`` and they
import it as ``bench_common``.
"""

from __future__ import annotations

import os
from typing import Any


def load_average() -> str:
    """The 1/5/15-minute load average and the CPU count, for the start and end of a run."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min, {os.cpu_count()} CPUs)"


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """Left-align the first column, right-align the others."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        line = "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        )
        print(f"  {line}")
        if index == 0:
            print(f"  {'  '.join('-' * w for w in widths)}")
