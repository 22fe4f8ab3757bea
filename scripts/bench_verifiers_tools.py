"""How many tool-server processes a batch of verifiers episodes starts, and how long it takes.

Plays ``--groups`` x ``--group-size`` episodes of the add-tool taskset twice per variant
(the first batch after the environment starts, then a second one) against a scripted engine
(every episode calls ``add`` once, then answers) on a tiny model built here, for:

- ``taskset``: `grpo.testing.verifiers_add_tool`, whose tool is declared in
  ``Taskset.toolsets``: verifiers serves it once per environment (per collector worker);
- ``episode``: `grpo.testing.verifiers_episode_tools`, the same tool in ``Task.toolsets``:
  verifiers starts a server for every episode; with ``max_concurrent_episodes`` given, at
  most that many episodes (their servers included) run at once.

Counted: processes started (``subprocess.Popen``: the servers, their readiness probes, and
verifiers' one-off ``git`` and ``uname`` look-ups) when the environment starts and per batch,
the most tool servers alive at once (polled every 50 ms) and wall time per batch. On a machine
shared with other work the wall clock measures the neighbours too: the load average is printed.

Usage:
    python scripts/bench_verifiers_tools.py                       # 2 groups x 4, bounds 2 and 4
    python scripts/bench_verifiers_tools.py --groups 8 --group-size 8 --bounds 8 16
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import load_average, print_table

_STARTED: list[str] = []


def _count_processes(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        _STARTED.append(str(args[0]))


class _Peak:
    """The most tool-server processes (``python -m ...``) alive at once under this process."""

    def __init__(self) -> None:
        import psutil

        self.value = 0
        self._me = psutil.Process()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while True:
            try:
                alive = sum(
                    " -m " in " ".join(child.cmdline())
                    for child in self._me.children(recursive=True)
                )
            except Exception:  # a child exited while being read
                continue
            self.value = max(self.value, alive)
            time.sleep(0.05)


class _Engine:
    """Calls the ``add`` tool when it is offered, then answers with its result."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, requests):
        from grpo.envs.rollout import Sample

        samples = []
        for request in requests:
            text = self.tokenizer.decode(request.token_ids)
            a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
            results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
            call = json.dumps({"name": "add", "arguments": {"a": int(a), "b": int(b)}})
            reply = (
                f"The answer is {results[-1]}." if results else f"<tool_call>\n{call}\n</tool_call>"
            )
            ids = [*self.tokenizer.encode(reply), self.end]
            samples.append(Sample(ids, [-0.5] * len(ids), "stop"))
        return samples


def _run(taskset: str, model_dir: Path, tokenizer, args, bound: int | None) -> list:
    from grpo.envs import verifiers_env

    env = verifiers_env(taskset, max_turns=3, max_concurrent_episodes=bound)
    peak = _Peak()
    started = len(_STARTED)
    env.start(str(model_dir), max_model_len=1024, max_tokens=64, temperature=1.0, top_p=1.0)
    examples = env.examples()[: args.groups]
    row = [len(_STARTED) - started]
    try:
        for batch in range(2):
            started, clock = len(_STARTED), time.perf_counter()
            groups = env.run_groups(
                examples,
                _Engine(tokenizer),
                group_size=args.group_size,
                max_tokens=64,
                seed=batch,
            )
            seconds = time.perf_counter() - clock
            errors = [e.error for g in groups for e in g if e.error]
            if errors:
                raise RuntimeError(f"{len(errors)} episodes failed: {errors[0]}")
            row += [len(_STARTED) - started, f"{seconds:.1f}"]
    finally:
        env.close()
    return [*row, peak.value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--bounds", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args()
    sys.addaudithook(_count_processes)

    from transformers import AutoTokenizer

    from grpo.testing.tiny_models import build_tiny_qwen2

    model_dir = build_tiny_qwen2(Path(tempfile.mkdtemp()) / "model", tool_calls=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    print(f"load average at start: {load_average()}")
    variants = [
        ("taskset (Taskset.toolsets)", "grpo.testing.verifiers_add_tool", None),
        ("episode (Task.toolsets)", "grpo.testing.verifiers_episode_tools", None),
        *(
            (f"episode, max_concurrent_episodes={n}", "grpo.testing.verifiers_episode_tools", n)
            for n in args.bounds
        ),
    ]
    rows = [[name, *_run(taskset, model_dir, tokenizer, args, n)] for name, taskset, n in variants]
    print_table(
        f"{args.groups} groups x {args.group_size} episodes of the add-tool taskset, two batches",
        [
            "tool servers",
            "processes at start",
            "processes, batch 1",
            "s",
            "processes, batch 2",
            "s",
            "most servers at once",
        ],
        rows,
    )
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
