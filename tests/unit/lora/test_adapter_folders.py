"""Adapter folders of collectors that were killed are deleted by the next collector to start."""

from __future__ import annotations

import os
import subprocess
import sys

from grpo.process_pool import remove_orphaned_folders
from grpo.weights.adapter import ADAPTER_DIR_PREFIX


def test_the_folders_of_dead_collectors_go_and_the_live_ones_stay(tmp_path):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(finished.stdout)  # its process has exited
    dead = tmp_path / f"{ADAPTER_DIR_PREFIX}{dead_pid}-k3j9x_0a"
    live = tmp_path / f"{ADAPTER_DIR_PREFIX}{os.getpid()}-p2m8q1zz"
    unrelated = tmp_path / f"{ADAPTER_DIR_PREFIX}notapid-x"
    for folder in (dead, live, unrelated):
        (folder / "v3").mkdir(parents=True)
        (folder / "v3" / "adapter_model.safetensors").write_bytes(b"weights")

    assert remove_orphaned_folders(ADAPTER_DIR_PREFIX, tmp_path) == [str(dead)]
    assert not dead.exists()
    assert (live / "v3" / "adapter_model.safetensors").is_file()
    assert unrelated.is_dir()
