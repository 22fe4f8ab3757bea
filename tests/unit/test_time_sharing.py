"""Time-sharing one GPU with the trainer (``inference.sleep_while_training``): the collector's
vLLM engine sleeps while the trainer steps, and wakes for generation in a fixed order (weights,
the new or the kept weights, KV cache, probe) that proves it computes with the right weights.

vLLM's CPU worker does nothing on ``sleep`` and ``wake_up`` (it logs that sleep mode is not
supported) but its engine keeps their bookkeeping, so a real run on CPU runs, and records,
the whole sequence. What a GPU would free and restore is not exercised here.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_time_sharing.py.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from grpo.config import ConfigError, load_config
from grpo.observability.metric_names import (
    INFERENCE_TIME_ASLEEP,
    INFERENCE_TIME_TO_WAKE,
)
from grpo.weights.checksum import WeightSyncError, state_dict_checksum
from grpo.weights.receiver import EngineWeights
from grpo.workers.engine_sleep import EngineSleep, sleep_engine_args, sleep_level

# ------------------------------------------------------------------ a one-weight fake engine


def logprob(scale: float, token: int) -> float:
    """The fake model's logprob of ``token``: its one weight, ``scale``, times a token term."""
    return -scale * (1 + token % 5)


def weights_of(scale: float) -> dict[str, torch.Tensor]:
    return {"scale": torch.tensor([scale])}


def probe_of(scale: float) -> dict:
    """The trainer's probe of weights ``scale``: its logprobs of a fixed sequence."""
    token_ids = list(range(3, 19))
    return {"token_ids": token_ids, "logprobs": [logprob(scale, t) for t in token_ids[1:]]}


class FakeLLM:
    """``vllm.LLM`` as `EngineWeights` and `EngineSleep` use it, for a one-weight model.

    Like vLLM, sleep level 1 keeps the weights (in host memory) and level 2 drops them; a
    request stepped while any memory sleeps fails (vLLM's scheduler stays paused until every
    tag is awake). Two faults on demand: ``after_wake`` is what the weights memory holds once
    woken (a stale weight, or NaN for garbage), whatever the level; ``skip_loads`` makes a load
    hash the tensors it received but keep computing with the old weight.
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.after_wake: float | None = None
        self.skip_loads = False
        # Before any update the worker hashes the model folder's files: the same tensors.
        self.checksum = state_dict_checksum(weights_of(scale))
        self.sleeping: set[str] = set()
        self._kept = scale
        self._requests: list[tuple[str, list[int]]] = []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 64))

    def sleep(self, level: int = 1) -> None:
        self._kept = self.scale if level == 1 else math.nan
        self.scale = math.nan  # its memory is released
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        for tag in tags:
            self.sleeping.remove(tag)  # KeyError: woken twice, or never slept
        if "weights" in tags:
            self.scale = self._kept if self.after_wake is None else self.after_wake
        return not self.sleeping

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "grpo_weights_checksum":
            return [self.checksum]
        assert method == "grpo_update_weights", method
        assert "weights" not in self.sleeping, "weights loaded into memory that sleeps"
        weights, compute = args
        if not self.skip_loads:
            self.scale = float(weights["scale"])
        self.checksum = state_dict_checksum(weights) if compute else None
        return [self.checksum]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    # The engine `EngineWeights` steps: ``add_request`` and one scheduler step.
    def add_request(self, request_id: str, token_ids: list[int], params: object) -> None:
        self._requests.append((request_id, list(token_ids)))

    def step(self) -> list[SimpleNamespace]:
        assert not self.sleeping, f"a request stepped while {sorted(self.sleeping)} sleep"
        outputs = [
            SimpleNamespace(
                request_id=request_id,
                finished=True,
                outputs=[],
                prompt_logprobs=[None]
                + [{t: SimpleNamespace(logprob=logprob(self.scale, t))} for t in token_ids[1:]],
            )
            for request_id, token_ids in self._requests
        ]
        self._requests = []
        return outputs


def sleeping_engine(llm: FakeLLM, level: int, model_dir: Path) -> tuple[EngineWeights, EngineSleep]:
    """The weights of ``llm`` (version 0: ``model_dir``'s) and their `EngineSleep`."""
    model_dir.mkdir(exist_ok=True)
    save_file(weights_of(llm.scale), str(model_dir / "model.safetensors"))
    lock = threading.RLock()
    weights = EngineWeights(
        llm, lock, llm.add_request, llm.step, owner="inference[0]", model_dir=str(model_dir),
        policy_version=0,
    )  # fmt: skip
    return weights, EngineSleep(llm, weights, lock, level, "inference[0]")


def receive(weights: EngineWeights, version: int, scale: float) -> None:
    """The trainer's update of ``version``: weights ``scale``, their checksum and probe."""
    checksum = state_dict_checksum(weights_of(scale))
    assert weights.receive(weights_of(scale), version, checksum, probe_of(scale))


def load_and_verify(weights: EngineWeights) -> functools.partial:
    return functools.partial(weights.apply_pending, "between_batches")


def test_the_sleep_level_and_engine_arguments():
    assert sleep_level(lora=True) == 1 and sleep_level(lora=False) == 2
    # vLLM refuses enable_sleep_mode on CPU, where sleep and wake_up do nothing anyway.
    assert sleep_engine_args(on_cpu=True) == {}
    assert sleep_engine_args(on_cpu=False) == {"enable_sleep_mode": True}


def test_every_wake_loads_new_or_kept_weights_then_the_kv_cache_then_probes(tmp_path):
    """Level 2 drops the weights: each wake loads the pending update or, with nothing pending,
    the weights it had (the model folder's before any update), and always ends with a probe
    of the version it then holds, after the KV cache is back."""
    llm = FakeLLM(scale=1.0)
    weights, sleeper = sleeping_engine(llm, 2, tmp_path / "model")
    apply = load_and_verify(weights)

    assert sleeper.sleep() == {}  # no probe from a trainer yet: the engine's own is kept
    assert math.isnan(llm._kept)  # level 2: dropped, not kept in host memory
    sleeper.apply_pending(apply)  # nothing synced meanwhile (weight_sync.every_n_steps 2)
    assert llm.scale == 1.0 and weights.policy_version == 0

    sleeper.sleep()
    receive(weights, 1, scale=2.0)  # synced while the engine slept
    sleeper.apply_pending(apply)
    assert llm.scale == 2.0 and weights.policy_version == 1

    cycle = sleeper.sleep()
    assert set(cycle) == {INFERENCE_TIME_ASLEEP, INFERENCE_TIME_TO_WAKE}
    assert all(seconds >= 0 for seconds in cycle.values())
    sleeper.apply_pending(apply)  # nothing pending: version 1 from host memory
    assert llm.scale == 2.0 and weights.policy_version == 1 and not sleeper.asleep

    assert list(sleeper.events) == [
        *("sleep(2)", "wake(weights)", "reload(v0)", "wake(kv_cache)", "probe(v0)"),
        *("sleep(2)", "wake(weights)", "load(v1)", "wake(kv_cache)", "probe(v1)"),
        *("sleep(2)", "wake(weights)", "reload(v1)", "wake(kv_cache)", "probe(v1)"),
    ]


def test_an_engine_that_wakes_with_stale_weights_fails_the_probe_naming_the_version(tmp_path):
    """The engine woke holding the old weights and its load of the new ones hashed them but
    kept computing with the old (the bytes arrived, the engine does not use them): the
    checksum passes, the probe of version 1 does not, and the engine refuses to generate."""
    llm = FakeLLM(scale=1.0)
    weights, sleeper = sleeping_engine(llm, 2, tmp_path / "model")
    apply = load_and_verify(weights)
    sleeper.sleep()
    receive(weights, 1, scale=2.0)
    llm.after_wake, llm.skip_loads = 1.0, True

    with pytest.raises(WeightSyncError, match="weights of version 1: the engine's probe"):
        sleeper.apply_pending(apply)
    assert list(sleeper.events) == [
        *("sleep(2)", "wake(weights)", "load(v1)", "wake(kv_cache)", "wake failed"),
    ]
    assert weights.policy_version == 0 and sleeper.asleep
    # The next batch tries to wake it again: it still holds weights nobody vouched for.
    with pytest.raises(WeightSyncError, match="holds unverified weights"):
        sleeper.apply_pending(apply)


def test_a_wake_with_nothing_pending_probes_the_weights_it_holds(tmp_path):
    """TRL issue 5313: an engine woken from a level-1 sleep serves garbage (memory that was
    not restored) although nothing new was loaded. The kept probe of version 1 runs after the
    wake and fails, NaN logprobs included."""
    llm = FakeLLM(scale=1.0)
    weights, sleeper = sleeping_engine(llm, 1, tmp_path / "model")
    apply = load_and_verify(weights)
    sleeper.sleep()
    receive(weights, 1, scale=2.0)
    sleeper.apply_pending(apply)
    sleeper.sleep()
    llm.after_wake = math.nan

    with pytest.raises(WeightSyncError, match="weights of version 1: .* by up to nan"):
        sleeper.apply_pending(apply)
    assert list(sleeper.events)[-4:] == [
        "sleep(1)",
        "wake(weights)",
        "wake(kv_cache)",
        "wake failed",
    ]


# ------------------------------------------------------------------ configuration


def test_sleeping_while_training_needs_a_synchronous_run():
    with pytest.raises(ConfigError) as info:
        load_config("tiny_arithmetic_cpu", ["inference.sleep_while_training=true"])
    assert info.value.problems == [
        "inference.sleep_while_training: needs orchestration.synchronous: true (vLLM sleeps "
        "while the trainer steps, so nothing may generate meanwhile)"
    ]
    cfg = load_config(
        "tiny_arithmetic_cpu",
        ["inference.sleep_while_training=true", "orchestration.synchronous=true"],
    )
    assert cfg.inference.sleep_while_training and cfg.orchestration.synchronous


def test_a_trainer_and_a_collector_sharing_a_gpu_cannot_use_the_collective_transport():
    """NCCL refuses two ranks on one device: fractions of a GPU need the object store."""
    shared = ["inference.num_gpus=0.5", "training.num_gpus=0.25", "ray.num_gpus=1"]
    with pytest.raises(ConfigError) as info:
        load_config("tiny_arithmetic_cpu", [*shared, "weight_sync.transport=collective"])
    [problem] = info.value.problems
    assert problem.startswith("weight_sync.transport: collective broadcasts over NCCL")
    assert "set weight_sync.transport: object_store" in problem
    load_config("tiny_arithmetic_cpu", [*shared, "weight_sync.transport=object_store"])
    # Whole GPUs each: separate devices, the collective transport is fine.
    whole = ["inference.num_gpus=1", "training.num_gpus=1", "ray.num_gpus=2"]
    load_config("tiny_arithmetic_cpu", [*whole, "weight_sync.transport=collective"])


# ------------------------------------------------------------------ a real run on CPU

# A synchronous run whose every step generates one batch (4 prompts x 8 = training.batch_size),
# synced every 2 steps: its wakes load the weights synced meanwhile or, with nothing synced,
# reload those they had (so a step between two syncs trains on a batch one step old).
SYNCHRONOUS = (
    "orchestration.synchronous=true",
    "orchestration.max_policy_lag=1",
    "weight_sync.every_n_steps=2",
    "training.lr_scheduler=null",
    "checkpoint.save_every_n_minutes=null",
    "inference.max_generated_tokens=12",
    "inference.batch_size=4",
    "training.batch_size=32",
    # A reward the random tiny model earns sometimes, so the steps change the weights.
    "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
    "ref.reward_weights=null",
)
