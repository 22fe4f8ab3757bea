"""Benchmark the weight transports against an in-memory copy of the same state dict.

For each state dict (the tiny demo model's HF weights, and a synthetic fp32 one of
``--synthetic-mb`` MiB), side by side in one run:

* clone: ``{k: v.clone()}`` in this process, the cost of one copy of every byte.
* object_store: a sender actor ``ray.put``s the state dict and a receiver actor ``ray.get``s
  it (what the ``object_store`` transport does between trainer rank 0 and a collector).
* collective: a sender actor broadcasts it over a two-rank gloo group (loopback) to a receiver
  actor, in flat buckets of ``--bucket-mb``, and the receiver rebuilds the named tensors
  (`grpo.weights.channel`, what the ``collective`` transport does).

Each transport is timed from the driver, end to end (until the receiver holds the named
tensors); the vLLM reload that follows is the same for both and is not included. Variants run
round-robin after one warm-up each (the machine may be shared); medians are printed, with the
ratio to the clone, and the load average at the start and the end.

Usage::

    python scripts/bench_weight_sync.py [--synthetic-mb 256] [--bucket-mb 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import load_average

from grpo.config import WeightSyncConfig  # noqa: E402
from grpo.models import load_hf_state_dict  # noqa: E402
from grpo.testing import build_tiny_qwen2  # noqa: E402
from grpo.weights.channel import (  # noqa: E402
    RECEIVER_RANK,
    SENDER_RANK,
    TensorSpec,
    WeightChannel,
    tensor_specs,
)


class Sender:
    """Holds a state dict, as trainer rank 0 does after a gather."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.channel: WeightChannel | None = None

    def put(self) -> list[Any]:
        return [ray.put(self.state)]  # in a list: the caller gets the reference, not the value

    def open(self, timeout_s: float) -> int:
        self.channel = WeightChannel("receiver", SENDER_RANK, "127.0.0.1", 0, timeout_s=timeout_s)
        return self.channel.port

    def send(self, bucket_bytes: int) -> None:
        self.channel.send(self.state, bucket_bytes)


class Receiver:
    """Receives a state dict, as a collector does before handing it to vLLM."""

    def __init__(self) -> None:
        self.channel: WeightChannel | None = None

    def get(self, refs: list[Any]) -> int:
        state = ray.get(refs[0])
        return len(state)

    def join(self, port: int, timeout_s: float) -> None:
        self.channel = WeightChannel(
            "receiver", RECEIVER_RANK, "127.0.0.1", port, timeout_s=timeout_s
        )

    def receive(self, specs: list[TensorSpec], bucket_bytes: int) -> int:
        return len(self.channel.receive(specs, bucket_bytes))


def synthetic_state_dict(megabytes: int) -> dict[str, torch.Tensor]:
    """fp32 tensors shaped like a small LLM's layers (16 MiB matrices), ``megabytes`` in all."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, megabytes // 16)
    return {
        f"model.layers.{i}.mlp.weight": torch.randn(2048, 2048, generator=generator)
        for i in range(count)
    }


def bench(state: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> dict[str, float]:
    actor_options = {"num_cpus": 0}
    sender = ray.remote(**actor_options)(Sender).remote(ray.put(state))
    receiver = ray.remote(**actor_options)(Receiver).remote()
    timeout_s = 300.0
    port = ray.get(sender.open.remote(timeout_s))
    ray.get(receiver.join.remote(port, timeout_s))  # the sender's side completes in the background
    specs = tensor_specs(state)

    def clone() -> None:
        {name: tensor.clone() for name, tensor in state.items()}

    def object_store() -> None:
        ray.get(receiver.get.remote(ray.get(sender.put.remote())))

    def collective() -> None:
        ray.get([sender.send.remote(bucket_bytes), receiver.receive.remote(specs, bucket_bytes)])

    variants = {"clone": clone, "object_store": object_store, "collective": collective}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for function in variants.values():
        function()
    for _ in range(repeats):
        for name, function in variants.items():
            start = time.perf_counter()
            function()
            seconds[name].append(time.perf_counter() - start)
    ray.kill(sender)
    ray.kill(receiver)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic-mb", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=WeightSyncConfig().bucket_mb)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {load_average()}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    bucket_bytes = int(args.bucket_mb * 2**20)
    with tempfile.TemporaryDirectory() as work_dir:
        tiny = load_hf_state_dict(build_tiny_qwen2(Path(work_dir) / "tiny"))
    cases = {"tiny demo model": tiny, "synthetic fp32": synthetic_state_dict(args.synthetic_mb)}
    print(f"\nweight transfer, median of {args.repeats} (bucket {args.bucket_mb:g} MiB)")
    print(
        f"  {'state dict':<18} {'MiB':>7} {'clone s':>9} {'object_store s':>15} "
        f"{'x clone':>8} {'collective s':>13} {'x clone':>8}"
    )
    for name, state in cases.items():
        mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        medians = bench(state, bucket_bytes, args.repeats)
        base = medians["clone"]
        print(
            f"  {name:<18} {mib:>7.1f} {base:>9.4f} {medians['object_store']:>15.4f} "
            f"{medians['object_store'] / base:>8.2f} {medians['collective']:>13.4f} "
            f"{medians['collective'] / base:>8.2f}"
        )
    print(f"\nload average at end: {load_average()}")
    ray.shutdown()


if __name__ == "__main__":
    main()
