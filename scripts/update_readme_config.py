"""Regenerate the README's config reference from the typed configs (grpo.config.run_schema).

python scripts/update_readme_config.py          # rewrite README.md in place
python scripts/update_readme_config.py --check  # exit 1 if README.md is out of date
"""

import argparse
import re
import sys
from pathlib import Path

from grpo.config import config_reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def rendered(text: str) -> str:
    """README text with the block between the markers replaced by the current reference."""
    block = f"{START}\n{config_reference_markdown().strip()}\n{END}"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{README} lacks the markers {START} ... {END}")
    return pattern.sub(lambda _: block, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, do not write")
    args = parser.parse_args()
    text = README.read_text()
    new_text = rendered(text)
    if args.check:
        if new_text != text:
            print("README.md config reference is out of date: run scripts/update_readme_config.py")
            return 1
        return 0
    README.write_text(new_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
