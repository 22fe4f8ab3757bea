"""Tiny models with a real family's tokens and published chat template, for tests.

Each family here is a tiny random checkpoint of the family's architecture whose tokenizer holds
that family's special tokens (chat markers, tool-call and thinking tokens) under their real
strings, with the family's eos, bos and stop tokens, and whose ``tokenizer_config.json`` carries
the chat template the caller gives: the one the family publishes (the tests keep those under
``tests/fixtures/chat_templates``). Rendering, environment turns and tool calls then meet the
real template, not a stand-in; vLLM serves the folder like any other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from grpo.testing.tiny_models import (
    LLAMA3_PRETOKENIZE_REGEX,
    QWEN2_PRETOKENIZE_REGEX,
    _added_tokens_decoder,
    _train_tokenizer,
    _write_json,
    build_tiny_llama,
    build_tiny_qwen2,
    build_tiny_qwen3,
)

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
# DeepSeek-R1-Distill-Qwen: only bos and eos are special; the chat markers and <think> are
# added tokens that are not, and its tool markers (<｜tool▁calls▁begin｜>...) are plain text.
DEEPSEEK_SPECIAL = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>")
DEEPSEEK_ADDED = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")


@dataclass(frozen=True)
class ChatFamily:
    """A family's tokens: which are special, which are plain added tokens, eos, bos, stops."""

    architecture: str  # "qwen2", "qwen3" or "llama"
    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]  # added, not special: decoding keeps them (<tool_call>)
    eos_token: str
    stop_tokens: tuple[str, ...]  # generation_config.json's eos_token_id
    bos_token: str | None = None  # prepended by the tokenizer when special tokens are added
    pad_token: str | None = None


FAMILIES: dict[str, ChatFamily] = {
    "qwen2_5": ChatFamily(
        "qwen2",
        QWEN_SPECIAL,
        ("<tool_call>", "</tool_call>"),
        eos_token="<|im_end|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>",
    ),
    "qwen3": ChatFamily(
        "qwen3",
        QWEN_SPECIAL,
        (
            "<tool_call>",
            "</tool_call>",
            "<think>",
            "</think>",
            "<tool_response>",
            "</tool_response>",
        ),
        eos_token="<|im_end|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        pad_token="<|endoftext|>",
    ),
    "llama3": ChatFamily(
        "llama",
        LLAMA3_SPECIAL,
        (),
        eos_token="<|eot_id|>",
        stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        bos_token="<|begin_of_text|>",
    ),
    "deepseek_r1_distill_qwen": ChatFamily(
        "qwen2",
        DEEPSEEK_SPECIAL,
        DEEPSEEK_ADDED,
        eos_token="<｜end▁of▁sentence｜>",
        stop_tokens=("<｜end▁of▁sentence｜>",),
        bos_token="<｜begin▁of▁sentence｜>",
        pad_token="<｜end▁of▁sentence｜>",
    ),
}


def build_tiny_chat_family(
    out_dir: str | os.PathLike, family: str, chat_template: str, *, vocab_size: int = 512
) -> Path:
    """Write a tiny random model of ``family`` with its tokens and ``chat_template``.

    Args:
        out_dir (str | os.PathLike): Folder to create.
        family (str): A key of `FAMILIES` (``qwen2_5``, ``qwen3``, ``llama3``,
            ``deepseek_r1_distill_qwen``).
        chat_template (str): The template ``tokenizer_config.json`` carries (the family's
            published one).
        vocab_size (int): Rows of the embedding: BPE tokens plus the family's tokens.

    Returns:
        Path: ``out_dir``.

    Raises:
        KeyError: If ``family`` is unknown.
    """
    spec = FAMILIES[family]
    builder = {"qwen2": build_tiny_qwen2, "qwen3": build_tiny_qwen3, "llama": build_tiny_llama}
    out_dir = builder[spec.architecture](out_dir, vocab_size=vocab_size)
    tokenizer = _train_tokenizer(
        bpe_vocab_size=vocab_size - len(spec.special_tokens) - len(spec.added_tokens),
        special_tokens=spec.special_tokens,
        pretokenize_regex=(
            LLAMA3_PRETOKENIZE_REGEX if spec.architecture == "llama" else QWEN2_PRETOKENIZE_REGEX
        ),
        bos_token=spec.bos_token,
        extra_tokens=spec.added_tokens,
    )
    special_ids = {token: tokenizer.token_to_id(token) for token in spec.special_tokens}
    added_ids = {token: tokenizer.token_to_id(token) for token in spec.added_tokens}
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    tokenizer.model.save(str(out_dir))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {
                **_added_tokens_decoder(special_ids),
                **{
                    key: {**entry, "special": False}
                    for key, entry in _added_tokens_decoder(added_ids).items()
                },
            },
            "bos_token": spec.bos_token,
            "eos_token": spec.eos_token,
            "pad_token": spec.pad_token,
            "chat_template": chat_template,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
        },
    )
    stop_ids = [special_ids[token] for token in spec.stop_tokens]
    generation_config = {"eos_token_id": stop_ids}
    config = json.loads((out_dir / "config.json").read_text())
    config["eos_token_id"] = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    if spec.bos_token is not None:
        config["bos_token_id"] = generation_config["bos_token_id"] = special_ids[spec.bos_token]
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config)
    return out_dir
