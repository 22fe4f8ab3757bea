"""Shared fixtures: tiny Qwen2 checkpoints built once per test session.

The folders are shared by every test of the session: treat them as read-only (copy one, e.g.
with ``shutil.copytree``, before changing it).
"""

from pathlib import Path

import pytest

from grpo.testing import build_tiny_qwen2, make_fake_model_dir


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


@pytest.fixture
def fake_model_dir(tmp_path: Path) -> Path:
    """A model folder that passes the config checks but holds no weights to load."""
    return make_fake_model_dir(tmp_path / "model")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs) for the tests of one module that use Ray directly.

    Module-scoped: one start-up (seconds) serves the whole module. A cluster that is already
    running is joined and left running; one this fixture started is shut down after the module.
    """
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_shared_by_session():
    """Shut down, at the end of the session, the Ray cluster that the last runs left up."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_shared(ray_shared_by_session):
    """Leave up, after the test, the Ray cluster that its run started or joined.

    The next run joins it: a start-up and a shutdown (seconds each) less. Runs end their
    actors however they end; a test that needs a cluster of its own (other CPU slots, Ray
    started under load) shuts the running one down first.
    """
