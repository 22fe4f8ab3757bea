"""Test support: tiny checkpoints built on the fly, and helpers for tests and drills.

Everything here is imported by scripts or inside Ray workers (fault injectors, tools, rewards,
agents and tasksets named by configs); helpers only the tests use live in ``tests/helpers``.

Example:
    >>> from grpo.testing import build_tiny_qwen2, tiny_vllm_engine_kwargs
    >>> model_dir = build_tiny_qwen2("/tmp/tiny_qwen2")
    >>> from vllm import LLM  # doctest: +SKIP
    >>> llm = LLM(model=str(model_dir), **tiny_vllm_engine_kwargs())  # doctest: +SKIP
"""

from grpo.testing.helpers import (
    RANDOM_MODEL_OVERRIDES,
    NonFiniteLoss,
    gathered_training_state,
    kill_at_steps,
    read_jsonl,
    start_tiny_run,
)
from grpo.testing.tiny_models import (
    BEGIN_OF_TEXT,
    CHATML_TEMPLATE,
    END_HEADER_ID,
    END_OF_TEXT,
    ENDOFTEXT,
    EOT_ID,
    IM_END,
    IM_START,
    LLAMA3_CHAT_TEMPLATE,
    LLAMA3_PRETOKENIZE_REGEX,
    LLAMA3_SPECIAL_TOKENS,
    QWEN2_PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    START_HEADER_ID,
    TINY_LLAMA_ROPE_SCALING,
    TOKENIZER_FILES,
    build_tiny_llama,
    build_tiny_qwen2,
    build_tiny_qwen3,
    make_fake_model_dir,
    set_vllm_cpu_env,
    tiny_corpus,
    tiny_vllm_engine_kwargs,
)

__all__ = [
    "RANDOM_MODEL_OVERRIDES",
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
    "NonFiniteLoss",
    "build_tiny_llama",
    "build_tiny_qwen2",
    "build_tiny_qwen3",
    "gathered_training_state",
    "kill_at_steps",
    "make_fake_model_dir",
    "read_jsonl",
    "set_vllm_cpu_env",
    "start_tiny_run",
    "tiny_corpus",
    "tiny_vllm_engine_kwargs",
]
