"""Actor classes resume garbage collection once built (grpo.workers.gc_pause)."""

import gc

import pytest

from grpo.workers.gc_pause import pause_gc, resumes_gc


class Built:
    """Records whether garbage collection ran while it was built."""

    def __init__(self, fail: bool = False) -> None:
        self.collecting_while_built = gc.isenabled()
        if fail:
            raise ValueError("cannot build")

    def name(self) -> str:
        return "built"


@pytest.fixture
def restore_gc():
    yield
    gc.unfreeze()
    gc.enable()


def test_the_constructor_runs_paused_and_collection_resumes_with_imports_frozen(restore_gc):
    cls = resumes_gc(Built)
    pause_gc()
    built = cls()
    assert not built.collecting_while_built
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert isinstance(built, Built) and built.name() == "built"
    assert (cls.__name__, cls.__qualname__, cls.__doc__) == (
        "Built",
        "Built",
        Built.__doc__,
    )


def test_collection_resumes_when_the_constructor_raises(restore_gc):
    pause_gc()
    with pytest.raises(ValueError, match="cannot build"):
        resumes_gc(Built)(fail=True)
    assert gc.isenabled()
