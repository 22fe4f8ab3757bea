"""Regenerate docs/config.md, the config reference, from the typed sections (grpo.config).

python scripts/update_config_docs.py          # rewrite docs/config.md
python scripts/update_config_docs.py --check  # exit 1 if docs/config.md is out of date
"""

import argparse
import sys
from pathlib import Path

from grpo.config import config_reference_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
HEADER = """# Config reference

Every key of a run config, its type, default and range, generated from the typed sections in
`grpo/config/sections.py` and `grpo/config/run.py` by `scripts/update_config_docs.py` (do not
edit by hand). An option is declared once, as one line of its section's pydantic model with its
docstring below it; its default, its checks in `grpo validate`, the row below and the typed
object the component receives (`SyncLLMCollector(..., config=InferenceConfig(...))`) all come
from that line. An unknown key is refused with the declared key it most likely means.

"""


def rendered() -> str:
    """The whole of docs/config.md as it should be."""
    return HEADER + config_reference_markdown().strip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, do not write")
    args = parser.parse_args()
    text = rendered()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run scripts/update_config_docs.py")
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
