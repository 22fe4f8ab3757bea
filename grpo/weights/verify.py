"""Proving an engine computes with the weights it was sent, and going back when it does not."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grpo.weights.checksum import WeightSyncError

PROBE_ID_PREFIX = "probe-"  # of a probe's request id, which no episode's request has
_PROBE_IDS = itertools.count()


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
        probe: ``{"token_ids", "logprobs", "atol", "rtol"}`` (``atol`` 1e-3 and ``rtol`` 0
            if absent).
        version: The version probed, for the error.

    Raises:
        WeightSyncError: If one differs by more than that, or is NaN.
    """
    atol, rtol = float(probe.get("atol", 1e-3)), float(probe.get("rtol", 0.0))
    got = torch.tensor(logprobs)
    expected = torch.tensor(probe["logprobs"], dtype=torch.float32)
    same_shape = got.shape == expected.shape
    diff = (got - expected).abs() if same_shape else torch.zeros(0)
    excess = float((diff - rtol * expected.abs()).max()) if diff.numel() else 0.0
    # "not <=" so NaN logprobs (e.g. memory a wake did not restore) fail too.
    if not same_shape or not excess <= atol:
        max_diff = float(diff.max()) if diff.numel() else float("nan")
        tolerance = f"atol {atol}" + (f", rtol {rtol}" if rtol else "")
        raise WeightSyncError(
            f"weights of version {version}: the engine's probe logprobs differ from the "
            f"sender's by {max_diff:.3g} ({tolerance}); the engine does not compute with the "
            "sent weights"
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
