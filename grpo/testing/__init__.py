"""Test support: tiny checkpoints built on the fly, and helpers for tests and drills.

Everything here is imported by scripts or inside Ray workers (fault injectors, tools, rewards,
agents and tasksets named by configs); helpers only the tests use live in ``tests/helpers``.

Example:
    >>> from grpo.testing import build_tiny_qwen2, tiny_vllm_engine_kwargs
    >>> model_dir = build_tiny_qwen2("/tmp/tiny_qwen2")
    >>> from vllm import LLM  # doctest: +SKIP
    >>> llm = LLM(model=str(model_dir), **tiny_vllm_engine_kwargs())  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name's module, imported on first use. Reward and tool worker processes import the
# submodules that configs name (`grpo.testing.tools`, `grpo.testing.rewards`); importing them
# runs this file, and the model builders below would bring torch into every such worker.
_HOME = {
    **dict.fromkeys(
        [
            "RANDOM_MODEL_OVERRIDES",
            "NonFiniteLoss",
            "gathered_training_state",
            "kill_at_steps",
            "read_jsonl",
            "start_tiny_run",
        ],
        "grpo.testing.helpers",
    ),
    **dict.fromkeys(
        [
            "BEGIN_OF_TEXT",
            "CHATML_TEMPLATE",
            "END_HEADER_ID",
            "END_OF_TEXT",
            "ENDOFTEXT",
            "EOT_ID",
            "IM_END",
            "IM_START",
            "LLAMA3_CHAT_TEMPLATE",
            "LLAMA3_PRETOKENIZE_REGEX",
            "LLAMA3_SPECIAL_TOKENS",
            "QWEN2_PRETOKENIZE_REGEX",
            "SPECIAL_TOKENS",
            "START_HEADER_ID",
            "TINY_LLAMA_ROPE_SCALING",
            "TOKENIZER_FILES",
            "build_tiny_llama",
            "build_tiny_qwen2",
            "build_tiny_qwen3",
            "make_fake_model_dir",
            "set_vllm_cpu_env",
            "tiny_corpus",
            "tiny_vllm_engine_kwargs",
        ],
        "grpo.testing.tiny_models",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'grpo.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


__all__ = sorted(_HOME)
