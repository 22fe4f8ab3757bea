"""Weight sync: the checksum definition, the transport, and in-place updates of a vLLM engine.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_weight_sync.py.
"""

from __future__ import annotations

import pytest
import torch

from grpo.weights.checksum import state_dict_checksum
from grpo.weights.engine import WeightReceiver, WeightUpdate

ENGINE_ARGS = {"kv_cache_memory_bytes": 64 * 2**20}
GROUP_SIZE = 2
MAX_GENERATED_TOKENS = 8


def random_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=generator),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=generator),
        "model.norm.weight": torch.randn(8, generator=generator),
    }


# ---------------------------------------------------------------------- checksum and transport


def test_checksum_ignores_order_device_and_float_width():
    state = random_state_dict()
    reference = state_dict_checksum(state)
    assert len(reference) == 32
    assert state_dict_checksum(dict(reversed(list(state.items())))) == reference
    assert state_dict_checksum(list(state.items())) == reference
    bf16 = {name: t.to(torch.bfloat16) for name, t in state.items()}
    # bf16 -> fp32 is exact, so a bf16 state dict and its upcast hash the same...
    upcast = {name: t.float() for name, t in bf16.items()}
    assert state_dict_checksum(bf16) == state_dict_checksum(upcast)
    # ...and rounding to bf16 changes values, hence the checksum.
    assert state_dict_checksum(bf16) != reference
    # Non-contiguous views hash by value.
    transposed = {**state, "model.norm.weight": state["model.norm.weight"].clone()}
    square = state["model.layers.0.self_attn.q_proj.weight"]
    transposed["model.layers.0.self_attn.q_proj.weight"] = square.t().contiguous().t()
    assert state_dict_checksum(transposed) == reference


def test_checksum_sees_every_value_name_and_shape():
    state = random_state_dict()
    reference = state_dict_checksum(state)
    for name, tensor in state.items():
        changed = tensor.clone()
        changed.view(-1)[-1] += 1e-6 * max(1.0, float(changed.view(-1)[-1].abs()))
        assert state_dict_checksum({**state, name: changed}) != reference, name
    renamed = dict(state)
    renamed["model.final_norm.weight"] = renamed.pop("model.norm.weight")
    assert state_dict_checksum(renamed) != reference
    reshaped = {
        **state,
        "model.embed_tokens.weight": state["model.embed_tokens.weight"].view(8, 16),
    }
    assert state_dict_checksum(reshaped) != reference
    missing = dict(state)
    missing.pop("model.norm.weight")
    assert state_dict_checksum(missing) != reference
    with pytest.raises(ValueError, match="duplicate"):
        state_dict_checksum([("a", torch.ones(1)), ("a", torch.ones(1))])


def test_each_configured_transport_has_one_implementation():
    from pydantic import ValidationError

    from grpo.choices import TRANSPORTS
    from grpo.config import WeightSyncConfig
    from grpo.weights.base import ReceivingEnd, SendingEnd
    from grpo.weights.transports import (
        RECEIVING_ENDS,
        SENDING_ENDS,
        receiving_end,
        sending_end,
    )

    assert set(SENDING_ENDS) == set(RECEIVING_ENDS) == set(TRANSPORTS)
    for name in TRANSPORTS:
        sender, receiver = sending_end(name, "training[0]", "cpu"), receiving_end(name, "c[0]")
        assert type(sender) is SENDING_ENDS[name] and isinstance(sender, SendingEnd)
        assert type(receiver) is RECEIVING_ENDS[name] and isinstance(receiver, ReceivingEnd)
    with pytest.raises(ValidationError, match="shared_memory"):
        WeightSyncConfig(transport="shared_memory")


def test_receiver_keeps_only_the_newest_update():
    receiver = WeightReceiver()
    assert not receiver.has_pending
    assert receiver.offer(WeightUpdate(version=2, weights={}), current_version=0)
    assert receiver.offer(WeightUpdate(version=3, weights={}), current_version=0)
    assert receiver.num_superseded == 1
    # Older than the pending one, or not newer than what the engine holds: ignored.
    assert not receiver.offer(WeightUpdate(version=1, weights={}), current_version=0)
    assert not receiver.offer(WeightUpdate(version=3, weights={}), current_version=0)
    assert not WeightReceiver().offer(WeightUpdate(version=4, weights={}), current_version=4)
    assert receiver.num_ignored == 2
    assert receiver.has_pending


# ---------------------------------------------------------------------- a real vLLM engine


SWITCH_STEP = 3  # the in-flight tests load new weights after this many tokens of each sample


def test_an_engine_that_cannot_preempt_is_refused_naming_the_option():
    from grpo.workers.vllm_engine import check_in_flight_updates

    class OldEngine:
        def reset_prefix_cache(self) -> bool:
            return True

    with pytest.raises(ValueError, match="inference.weight_updates=between_batches"):
        check_in_flight_updates(OldEngine())


def test_probe_tolerance_grows_with_the_logprob_under_rtol():
    from grpo.weights.checksum import WeightSyncError
    from grpo.weights.verify import check_probe

    sender = [-0.05, -2.0, -20.0]
    bf16 = {"token_ids": [1, 2, 3, 4], "logprobs": sender, "atol": 0.1, "rtol": 1.6e-2}
    # 0.08 at -0.05 (under atol) and 0.3 at -20 (under 0.1 + 0.32): rounding, accepted.
    check_probe([-0.13, -2.1, -20.3], bf16, version=3)
    # 0.15 at -0.05 is over 0.1 + 0.0008; 0.5 at -20 is over 0.42; NaN is never close.
    for got in ([-0.2, -2.0, -20.0], [-0.05, -2.0, -20.5], [-0.05, float("nan"), -20.0]):
        with pytest.raises(WeightSyncError, match="version 3.*up to .*atol 0.1, rtol 0.016"):
            check_probe(got, bf16, version=3)
    # Without rtol (fp32) the absolute bound alone applies, at every size.
    fp32 = {"token_ids": [1, 2, 3, 4], "logprobs": sender, "atol": 1e-3}
    check_probe([-0.0505, -2.0005, -20.0009], fp32, version=1)
    with pytest.raises(WeightSyncError, match=r"by up to 0.002 \(atol 0.001\)"):
        check_probe([-0.05, -2.0, -20.002], fp32, version=1)
    # A probe cut short says so, rather than a difference.
    with pytest.raises(WeightSyncError, match="version 1: the engine returned 2 probe logprobs"):
        check_probe([-0.05, -2.0], fp32, version=1)


def test_probe_tolerance_is_tight_only_in_float32():
    from grpo.weights.verify import FP32_PROBE_TOLERANCE, probe_token_ids, probe_tolerance

    assert probe_tolerance(torch.float32) == FP32_PROBE_TOLERANCE == (1e-3, 0.0, 1e-3, 0.0)
    assert (
        probe_tolerance(torch.bfloat16) == probe_tolerance(torch.float16) == (1.0, 0.05, 0.05, 0.02)
    )
    # Ids the smallest vocabulary holds, the same on both ends.
    assert probe_token_ids(300) == probe_token_ids(512) and max(probe_token_ids(50)) < 50


def test_reduced_precision_probe_passes_rounding_and_fails_on_other_weights():
    """bf16 rounding moves a token by half a nat on a trained model, the mean by under 1%."""
    from grpo.weights.checksum import WeightSyncError
    from grpo.weights.verify import check_probe, probe_tolerance

    sender = [-0.4, -3.0, -12.4, -7.0, -1.2, -9.5, -2.2, -15.0]
    probe = {"token_ids": list(range(9)), "logprobs": sender}
    probe |= probe_tolerance(torch.bfloat16)._asdict()
    # Like the demo model's bf16 probe of version 329, rejected under the earlier per-token
    # bound (0.1 + 0.016 * |logprob|): one token 0.25 off, the others close.
    rounding = [0.01, -0.02, 0.25, 0.03, 0.0, -0.05, 0.02, 0.06]
    check_probe([s + r for s, r in zip(sender, rounding)], probe, version=329)
    check_probe([s + (0.58 if i == 2 else 0.0) for i, s in enumerate(sender)], probe, version=1)
    # Other weights move every token: 0.4 each (5% of the mean |logprob| 6.34) is within a
    # token's bound, not the mean's (0.05 + 0.02 * 6.34).
    check_probe([s - 0.17 for s in sender], probe, version=2)
    with pytest.raises(WeightSyncError, match=r"by 0.4 on average \(at most 0.177\)"):
        check_probe([s - 0.4 for s in sender], probe, version=2)
    # One token far off (a wrong row of a weight) fails on its own, and so does NaN.
    with pytest.raises(WeightSyncError, match=r"version 3: .*up to 2.5 \(atol 1, rtol 0.05\)"):
        check_probe([s - (2.5 if i == 0 else 0.0) for i, s in enumerate(sender)], probe, version=3)
    with pytest.raises(WeightSyncError, match="version 4"):
        check_probe([float("nan"), *sender[1:]], probe, version=4)
