"""Proving an engine computes with the weights it was sent, and going back when it does not."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grpo.weights.checksum import WeightSyncError

PROBE_ID_PREFIX = "probe-"  # of a probe's request id, which no episode's request has
_PROBE_IDS = itertools.count()
# (atol, rtol) of a probe's logprobs. float32 on both ends agrees to ~1e-5. bf16 rounding
# differs between kernels, and more for larger logprobs: torch.testing's bf16 rtol on top of
# 0.1 (vLLM's CPU kernels were 0.127 off on the probe of a demo model trained for 30 steps).
FP32_PROBE_TOLERANCE = (1e-3, 0.0)
REDUCED_PRECISION_PROBE_TOLERANCE = (0.1, 1.6e-2)


def probe_token_ids(vocab_size: int) -> list[int]:
    """The fixed 16-token sequence that every probe scores (ids below 256 and ``vocab_size``)."""
    return [(7 * i + 3) % min(vocab_size, 256) for i in range(16)]


def probe_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` of a probe whose sender computes in ``dtype``."""
    return FP32_PROBE_TOLERANCE if dtype == torch.float32 else REDUCED_PRECISION_PROBE_TOLERANCE


def check_checksums(checksums: Sequence[str | None], expected: str, version: int) -> None:
    """Check the checksum each vLLM worker computed of the tensors it loaded.

    Raises:
        WeightSyncError: If a worker's differs from the sender's ``expected``.
    """
    for rank, checksum in enumerate(checksums):
        if checksum != expected:
            raise WeightSyncError(
                f"weights of version {version}: vLLM worker {rank} loaded tensors "
                f"with checksum {checksum}, the sender's checksum is {expected}"
            )


def probe_logprobs(
    add_request: Callable[[str, Sequence[int], Any], None],
    engine_step: Callable[[], list[Any]],
    token_ids: Sequence[int],
) -> list[float]:
    """The engine's logprob of every token of ``token_ids`` after the first.

    The probe is an ordinary request (hold the engine lock); running samples go on beside it.

    Args:
        add_request: ``add_request(request_id, token_ids, params)`` on the engine.
        engine_step: One step of the engine; returns the requests that finished.

    Returns:
        list[float]: ``len(token_ids) - 1`` logprobs, from unscaled logits.

    Raises:
        ValueError: With fewer than two token ids.
    """
    from vllm import SamplingParams

    token_ids = [int(t) for t in token_ids]
    if len(token_ids) < 2:
        raise ValueError(f"probe_logprobs needs at least 2 token ids, got {len(token_ids)}")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request_id = f"{PROBE_ID_PREFIX}{next(_PROBE_IDS)}"
    add_request(request_id, token_ids, params)
    output = None
    while output is None:
        output = next((o for o in engine_step() if o.request_id == request_id), None)
    # prompt_logprobs[0] is None: nothing precedes the first token.
    return [
        float(entry[token].logprob)
        for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])
    ]


def check_probe(logprobs: Sequence[float], probe: Mapping[str, Any], version: int) -> None:
    """Compare the engine's ``logprobs`` of a probe with the sender's.

    Each logprob may differ by ``atol + rtol * |sender's|``: rounding in a reduced precision
    grows with the value rounded, and a trained model puts logprobs of -20 and below on some
    probe tokens.

    Args:
        logprobs: `probe_logprobs` of ``probe["token_ids"]``.
        probe: ``{"token_ids", "logprobs", "atol", "rtol"}`` (`FP32_PROBE_TOLERANCE` if
            absent).
        version: The version probed, for the error.

    Raises:
        WeightSyncError: If one differs by more than that, or is NaN.
    """
    atol = float(probe.get("atol", FP32_PROBE_TOLERANCE[0]))
    rtol = float(probe.get("rtol", FP32_PROBE_TOLERANCE[1]))
    got = torch.tensor(logprobs)
    expected = torch.tensor(probe["logprobs"], dtype=torch.float32)
    if got.shape != expected.shape:
        raise WeightSyncError(
            f"weights of version {version}: the engine returned {got.numel()} probe logprobs, "
            f"the sender {expected.numel()}"
        )
    diff = (got - expected).abs()
    excess = float((diff - rtol * expected.abs()).max()) if diff.numel() else 0.0
    # "not <=" so NaN logprobs (e.g. memory a wake did not restore) fail too.
    if not excess <= atol:
        tolerance = f"atol {atol}" + (f", rtol {rtol}" if rtol else "")
        raise WeightSyncError(
            f"weights of version {version}: the engine's probe logprobs differ from the "
            f"sender's by {float(diff.max()):.3g} ({tolerance}); the engine does not compute "
            "with the sent weights"
        )


def roll_back(llm: Any, weights: Mapping[str, torch.Tensor] | None, model_dir: str) -> None:
    """Reload the weights from before a rejected update and drop every KV block it computed.

    Args:
        weights: Those weights; None: those of ``model_dir``, the engine's model folder.
    """
    if weights is None:
        from grpo.models import load_hf_state_dict

        weights = load_hf_state_dict(model_dir)
    llm.collective_rpc("grpo_update_weights", args=(weights, True))
    llm.reset_prefix_cache(reset_running_requests=True)
