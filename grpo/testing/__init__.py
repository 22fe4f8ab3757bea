"""Test support: tiny checkpoints built on the fly, and helpers for tests and drills.

Tests and the CPU demo cannot download a model, so they build one (`tiny_models`: Qwen2, Qwen3
or Llama 3 architecture): a small
randomly initialised decoder with a byte-level BPE tokenizer, written in the same Hugging Face
layout as a real checkpoint, so the same loading code (``grpo.models``, vLLM) serves both.
`helpers` holds what tests and drills need around it: a diverging loss, and helpers that run a
tiny run and kill its actors. Everything here is imported by scripts or inside Ray workers (fault
injectors, tools, rewards, agents and tasksets named by configs); helpers only the tests use live
in ``tests/helpers``.

Example:
    >>> from grpo.testing import build_tiny_qwen2, tiny_vllm_engine_kwargs
    >>> model_dir = build_tiny_qwen2("/tmp/tiny_qwen2")
    >>> from vllm import LLM  # doctest: +SKIP
    >>> llm = LLM(model=str(model_dir), **tiny_vllm_engine_kwargs())  # doctest: +SKIP
"""

from grpo.testing.helpers import (
    RANDOM_MODEL_OVERRIDES,
    NonFiniteLoss,
    assert_same_training_state,
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
    "assert_same_training_state",
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
