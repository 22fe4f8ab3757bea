"""Honest tool feedback: a call's timeout starts when a worker takes it, one episode's hanging
call stops nothing but its own worker, the wait for a worker is measured, async tools are
awaited, the worker count is the environment's, and a tool module beside the config imports.

Tools run for real in pebble worker processes; the policy's turns are written by hand. Calls
that hang are the built-in Python tool running ``time.sleep``: a fresh worker imports it
quickly, where importing `grpo.testing` would cost each replacement worker a torch import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from grpo.envs import Tool, ToolEnv, ToolRunner
from grpo.envs.base import Episode
from grpo.envs.builtin_tools import calculator, python
from grpo.envs.runner import default_tool_runner
from grpo.testing.tools import nap

SLEEP_30_S = "import time\ntime.sleep(30)"


def _turn(name: str, **arguments) -> Episode:
    """An episode whose last policy turn calls ``name`` with ``arguments``."""
    call = json.dumps({"name": name, "arguments": arguments})
    return Episode(
        example={},
        prompt_ids=[],
        messages=[{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}],
    )


def test_a_saturated_pool_times_out_only_the_hanging_calls():
    """Four episodes' calls hang past their 0.5 s timeout on both workers; four quick calls
    queued behind them wait longer than that timeout, yet each returns its result."""
    runner = ToolRunner(num_workers=2)
    env = ToolEnv(tools=[calculator, python], tool_timeout_s=0.5, runner=runner)
    hanging = [_turn("python", code=SLEEP_30_S) for _ in range(4)]
    quick = [_turn("calculator", expression=f"{n} * 7") for n in range(4)]
    try:
        start = time.monotonic()
        pending = [env.start_response(episode) for episode in hanging + quick]
        answers = [response.result() for response in pending]
        elapsed = time.monotonic() - start
    finally:
        runner.close()
    assert elapsed < 10, "the hanging calls were not stopped at their timeout"
    for episode, answer in zip(hanging, answers[:4]):
        assert answer == [{"role": "tool", "content": "error: the tool took longer than 0.5 s"}]
        assert episode.tool_errors == {"timeout": 1}
    for n, (episode, answer, response) in enumerate(zip(quick, answers[4:], pending[4:])):
        assert answer == [{"role": "tool", "content": str(n * 7)}]
        assert not episode.tool_errors
        assert not any(future.cancelled() for future in response.futures)
        # Two rounds of hanging calls ran before it: it waited past its own timeout.
        assert episode.stats()["tool_queue_wait_s"] > 0.5
        assert episode.stats()["tool_queue_wait_max_s"] == episode.stats()["tool_queue_wait_s"]
    # The first two hanging calls found idle workers; the next two waited for them.
    waits = [episode.stats()["tool_queue_wait_s"] for episode in hanging]
    assert sorted(waits)[2] > 0.4


def test_an_async_tool_is_awaited_in_its_worker():
    runner = ToolRunner(num_workers=1)
    try:
        [outcome] = runner.run([(Tool(nap), {"seconds": 0.05})], timeout_s=5.0)
    finally:
        runner.close()
    assert outcome.error is None and outcome.text == "napped 0.05 s"


def test_a_python_call_stopped_at_its_timeout_leaves_nothing_running():
    """The interpreter of a call past its timeout dies with its worker, not 30 s later."""
    runner = ToolRunner(num_workers=1)
    outcomes = []
    call = threading.Thread(
        target=lambda: outcomes.extend(runner.run([(Tool(python), {"code": SLEEP_30_S})], 1.0))
    )
    try:
        call.start()
        deadline = time.monotonic() + 5
        interpreters = []
        while not interpreters and time.monotonic() < deadline:
            time.sleep(0.05)
            interpreters = [
                child
                for child in psutil.Process().children(recursive=True)
                if "_root = os.path.realpath" in " ".join(_cmdline(child))
            ]
        call.join(timeout=15)
        _, alive = psutil.wait_procs(interpreters, timeout=3)
    finally:
        runner.close()
    assert interpreters, "the tool's interpreter never started"
    assert [outcome.error for outcome in outcomes] == ["timeout"]
    assert not alive, "the stopped call's interpreter outlived its worker"


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # it ended meanwhile
        return []


def test_tool_workers_sets_how_many_calls_run_at_once():
    """Three 2-second calls with three workers run together: none waits for another."""
    env = ToolEnv(tools=[python], tool_timeout_s=10.0, tool_workers=3)
    episodes = [
        _turn("python", code="import time\ntime.sleep(2)\nprint('slept')") for _ in range(3)
    ]
    try:
        for response in [env.start_response(episode) for episode in episodes]:
            assert response.result() == [{"role": "tool", "content": "slept\n"}]
    finally:
        default_tool_runner(env.tool_memory_mb, 3).close()
    # With two workers the third call would wait for one of the others: 2 s.
    assert max(episode.stats()["tool_queue_wait_s"] for episode in episodes) < 1.5
    with pytest.raises(ValueError, match="tool_workers"):
        ToolEnv(tools=[python], tool_workers=0)


def test_a_tool_module_in_the_launch_folder_imports(tmp_path):
    """``my_tools.convert`` names ./my_tools.py of the folder ``grpo`` runs in (the README's
    example), though a console script's sys.path starts at its own folder."""
    (tmp_path / "my_tools.py").write_text(
        "def convert(amount: float, rate: float) -> str:\n"
        '    """Convert an amount of money at an exchange rate."""\n'
        '    return f"{amount * rate:.2f}"\n'
    )
    script = Path(sys.executable).parent / "grpo"
    if not script.exists():
        pytest.skip("the grpo console script is not installed")
    result = subprocess.run(
        [
            str(script),
            "validate",
            "tiny_calculator_cpu",
            f"output_dir={tmp_path}/run",
            "environment.tools=[my_tools.convert,grpo.envs.calculator]",
            "environment.call_format=json",  # two parameters: `tag` passes one
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
