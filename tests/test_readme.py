import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_config_reference_matches_the_schema():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "update_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_shows_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert "make demo" in text and "make test" in text
