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
tensors); the vLLM reload that follows is the same for both and is timed apart.

With LoRA (``training.lora``) only the adapter travels: the demo model's rank-16 adapter on all
seven projections is a case of its own. Then, on one vLLM engine (the demo model, LoRA enabled),
the two ways a collector takes an update: a full in-place reload (`grpo_update_weights`) and an
adapter load (`grpo.weights.adapter.EngineAdapters`: PEFT folder written, checksum read back,
``add_lora``), each followed by the same probe forward. Variants run
round-robin after one warm-up each (the machine may be shared); medians are printed, with the
ratio to the clone, and the load average at the start and the end.

Usage::

    python scripts/bench_weight_sync.py [--synthetic-mb 256] [--bucket-mb 32] [--repeats 5]
        [--no-engine]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import load_average

from grpo.choices import LORA_TARGETS  # noqa: E402
from grpo.config import LoRAConfig, WeightSyncConfig  # noqa: E402
from grpo.models import load_hf_state_dict  # noqa: E402
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


def round_robin_medians(variants: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of each variant, after one warm-up each, run round-robin ``repeats``
    times (a shared machine's load then weighs on every variant alike)."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for function in variants.values():
        function()
    for _ in range(repeats):
        for name, function in variants.items():
            start = time.perf_counter()
            function()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


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
    medians = round_robin_medians(variants, repeats)
    ray.kill(sender)
    ray.kill(receiver)
    return medians


DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny_arithmetic_qwen2"
DEMO_LORA = {"rank": 16, "alpha": 32.0, "target_modules": list(LORA_TARGETS)}


def demo_adapter() -> dict[str, torch.Tensor]:
    """The demo model's adapter as the trainer sends it (PEFT names), B moved off zero."""
    from grpo.models import build_model, load_hf_config
    from grpo.models.lora import adapter_state_dict, apply_lora, peft_adapter_state_dict

    model = build_model(DEMO_MODEL)
    torch.manual_seed(0)
    apply_lora(model, LoRAConfig(**DEMO_LORA))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_b" in name:
                parameter.normal_(std=0.01)
    return peft_adapter_state_dict(
        adapter_state_dict(model.state_dict()), load_hf_config(DEMO_MODEL)
    )


def bench_engine_loads(
    full: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], repeats: int
) -> dict[str, float]:
    """Median seconds of a full reload and of an adapter load into one vLLM engine, each with
    the probe forward that verifies it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from grpo.models.lora import peft_adapter_config
    from grpo.testing import tiny_vllm_engine_kwargs
    from grpo.weights.adapter import EngineAdapters, engine_lora_args
    from grpo.weights.checksum import state_dict_checksum
    from grpo.weights.engine import WORKER_EXTENSION_CLS

    kwargs = {**tiny_vllm_engine_kwargs(max_model_len=128), **engine_lora_args(16)}
    llm = LLM(model=str(DEMO_MODEL), worker_extension_cls=WORKER_EXTENSION_CLS, **kwargs)
    adapters = EngineAdapters(llm, peft_adapter_config(LoRAConfig(**DEMO_LORA), str(DEMO_MODEL)))
    probe = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    tokens = {"prompt_token_ids": list(range(3, 19))}
    version = 0

    def full_reload() -> None:
        llm.collective_rpc("grpo_update_weights", args=(full, True))
        llm.reset_prefix_cache()
        llm.generate(tokens, probe, use_tqdm=False)

    def adapter_load() -> None:
        nonlocal version
        version += 1
        adapters.load(adapter, version, state_dict_checksum(adapter))
        adapters.activate(version)
        llm.generate(tokens, probe, lora_request=adapters.request_added("p"), use_tqdm=False)
        adapters.request_finished("p")

    variants = {"full reload": full_reload, "adapter load": adapter_load}
    medians = round_robin_medians(variants, repeats)
    adapters.close()
    llm.llm_engine.engine_core.shutdown()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic-mb", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=WeightSyncConfig().bucket_mb)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-engine", action="store_true", help="skip the vLLM load timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {load_average()}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    bucket_bytes = int(args.bucket_mb * 2**20)
    full = load_hf_state_dict(DEMO_MODEL)
    adapter = demo_adapter()
    cases = {
        "demo model, full": full,
        "demo model, LoRA": adapter,
        "synthetic fp32": synthetic_state_dict(args.synthetic_mb),
    }
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
    ray.shutdown()
    if not args.no_engine:
        loads = bench_engine_loads(full, adapter, args.repeats)
        print(f"\nvLLM load + probe of one update, demo model, median of {args.repeats}")
        for name, value in loads.items():
            print(f"  {name:<14} {value:>8.4f} s  x full {value / loads['full reload']:>5.2f}")
    print(f"\nload average at end: {load_average()}")


if __name__ == "__main__":
    main()
