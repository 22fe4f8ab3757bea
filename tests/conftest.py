"""Shared fixtures: tiny Qwen2 checkpoints built once per test session.

The folders are shared by every test of the session: treat them as read-only (copy one, e.g.
with ``shutil.copytree``, before changing it).
"""

from pathlib import Path

import pytest

from grpo.testing import build_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 checkpoint with tied embeddings (like Qwen2.5-0.5B), default arguments."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2") / "tied")


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 checkpoint with a separate ``lm_head.weight`` (like Qwen2.5-7B)."""
    return build_tiny_qwen2(
        tmp_path_factory.mktemp("tiny_qwen2") / "untied", tie_word_embeddings=False
    )
