"""Tiny Qwen2, Qwen3 and Llama 3 checkpoints built on the fly, and vLLM settings for a CPU.

Tests and the CPU demo cannot download a model, so they build one: a random decoder with a small
byte-level BPE tokenizer, in the Hugging Face layout of a real checkpoint, so the same loading
code (``grpo.models``, transformers, vLLM) serves both. Every file is a deterministic function of
the arguments, so a rebuild is byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers import processors as tokenizer_processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Qwen2's pre-tokenizer: contractions, letter runs, single digits (so numbers split digit by
# digit), punctuation runs, newlines and spaces. Identical to the regex of torchtune's and
# transformers' Qwen2 tokenizers; any difference would make the two disagree on token ids.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3's pre-tokenizer: as Qwen2's, but numbers split into runs of up to three digits.
LLAMA3_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Appended after the BPE vocabulary, in this order, as in Qwen2 (where they are 151643..151645).
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER_ID = "<|start_header_id|>"
END_HEADER_ID = "<|end_header_id|>"
EOT_ID = "<|eot_id|>"
# Llama 3's special tokens, in the order of their ids there (128000.., reserved ones left out).
LLAMA3_SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER_ID, END_HEADER_ID, EOT_ID)

# Llama 3 instruct's chat format (its template without tools and the date header): bos, then
# per message a header and the content closed by <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# RoPE scaling of the tiny Llama: Llama 3.1's kind with a short original context, so that most
# frequencies are rescaled and a model that ignored the scaling would compute other logits.
TINY_LLAMA_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# ChatML, the format of Qwen2 instruct models; lets vLLM's chat API work on the tiny model.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2.5's tool-call delimiters, tokens of their own there (151657, 151658).
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")

# ChatML with Qwen2.5's tool calling: the tools listed in the system turn, each call as a
# <tool_call> JSON block in the assistant turn, tool results in a user turn as
# <tool_response> blocks (Qwen2.5's template, without its default system prompt).
TOOL_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures, within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Files written next to the weights; `grpo.models.save_hf_checkpoint` copies them along.
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Let me think step by step about this problem.",
    "First, add the two numbers. Then check the result.",
    "The answer is the sum of both numbers.",
    "A conversation between a user and an assistant.",
    "The assistant first thinks about the reasoning process and then gives the answer.",
    "Solve the following math problem and put the final answer in the answer tags.",
    "You are a helpful assistant that solves arithmetic problems.",
    "system user assistant question answer reasoning result total",
    "If Tom has 12 apples and gives 5 to Anna, how many apples does Tom have left?",
    "Each box holds 8 pencils. How many pencils are in 7 boxes?",
    "She walked 3 miles on Monday and 4 miles on Tuesday.",
    "Compute the product, the difference and the quotient.",
    "Therefore, the final answer is correct.",
    "Wait, that is not right. Let me try again.",
    "Café, naïve, über, déjà vu: unicode text is encoded byte by byte.",
)


def tiny_corpus() -> Iterator[str]:
    """Yield the fixed training text of the tiny tokenizer, one line at a time: generated by
    fixed loops, so the learned merges are the same on every machine."""
    for repeat in range(4):
        for sentence in _SENTENCES:
            yield sentence if repeat % 2 == 0 else sentence.lower()
    for a in range(3, 100, 7):
        for b in range(2, 100, 11):
            yield f"What is {a} + {b}?"
            yield f"<think>{a} + {b} = {a + b}</think> <answer>{a + b}</answer>"
            yield f"What is {a} - {b}?"
            yield f"<think>\nI subtract {b} from {a}.\n</think>\n<answer>{a - b}</answer>"
            yield f"What is {a} * {b}?"
            yield f"<think>{a} times {b} is {a * b}.</think><answer>{a * b}</answer>"


def _train_tokenizer(
    bpe_vocab_size: int,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    pretokenize_regex: str = QWEN2_PRETOKENIZE_REGEX,
    bos_token: str | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Tokenizer:
    """Train a byte-level BPE on `tiny_corpus` and append the special tokens, then
    ``extra_tokens``; with ``bos_token`` set, a post-processor prepends it as Llama 3's does."""
    tokenizer = Tokenizer(
        BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    # The pipeline of Qwen2's tokenizer.json: NFC, regex split, byte-level mapping.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = tokenizer_processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        # All 256 byte symbols, so any text encodes without an unknown token (torchtune's
        # Qwen2Tokenizer has no unk id by default and would emit None).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(tiny_corpus(), trainer=trainer)
    # Added after training so they get the ids right after the BPE vocabulary and stay out of
    # vocab.json, as in Qwen2 and Llama 3; torchtune reads them from tokenizer.json.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False)
            for token in special_tokens
        ]
    )
    # Whole-word tokens of a tool-call format (Qwen2.5's <tool_call>) after them; as in Qwen2.5
    # they are added tokens that are not special (decoding keeps them).
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False, lstrip=False, rstrip=False)
            for token in extra_tokens
        ]
    )
    if bos_token is not None:
        bos = (bos_token, tokenizer.token_to_id(bos_token))
        tokenizer.post_processor = tokenizer_processors.Sequence(
            [
                tokenizer_processors.ByteLevel(
                    add_prefix_space=False, trim_offsets=False, use_regex=False
                ),
                tokenizer_processors.TemplateProcessing(
                    single=f"{bos_token}:0 $A:0",
                    pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
                    special_tokens=[bos],
                ),
            ]
        )
    return tokenizer


def _init_weights(
    *,
    num_layers: int,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_dim: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    seed: int,
    qkv_bias: bool = True,
    qk_norm: bool = False,
) -> dict[str, torch.Tensor]:
    """Random decoder weights under Hugging Face names, seeded.

    Linear weights have std ``1/sqrt(fan_in)`` and norms are ``1 + noise`` rather than the usual
    0.02 and 1, so a misplaced weight changes the logprobs by far more than a test tolerance
    instead of hiding in a near-uniform softmax.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    def linear(out_dim: int, in_dim: int) -> torch.Tensor:
        return normal(out_dim, in_dim, std=in_dim**-0.5)

    def norm_weight(dim: int = embed_dim, std: float = 0.1) -> torch.Tensor:
        return 1.0 + normal(dim, std=std)

    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    # Final hidden states have RMS ~1, so output rows of std 0.1 give logits of std ~0.1 *
    # sqrt(embed_dim) (~1.1 at 128): varied, but not so peaked that sampling never explores.
    weights = {"model.embed_tokens.weight": normal(vocab_size, embed_dim, std=0.1)}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        # The draw order of Qwen2's tensors is kept, so its files stay byte-identical.
        for name, out_dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            weights[f"{prefix}.self_attn.{name}.weight"] = linear(out_dim, embed_dim)
            if qkv_bias:
                weights[f"{prefix}.self_attn.{name}.bias"] = normal(out_dim, std=0.1)
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(embed_dim, q_dim)
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(intermediate_dim, embed_dim)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(intermediate_dim, embed_dim)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(embed_dim, intermediate_dim)
        weights[f"{prefix}.input_layernorm.weight"] = norm_weight()
        weights[f"{prefix}.post_attention_layernorm.weight"] = norm_weight()
        if qk_norm:
            # Wider spread than the other norms: the scales of the two channels that RoPE
            # rotates together then differ clearly, so norming after RoPE instead of before
            # (the order HF Qwen3 uses) would show in the logits.
            weights[f"{prefix}.self_attn.q_norm.weight"] = norm_weight(head_dim, std=0.3)
            weights[f"{prefix}.self_attn.k_norm.weight"] = norm_weight(head_dim, std=0.3)
    weights["model.norm.weight"] = norm_weight()
    if not tie_word_embeddings:
        # Real checkpoints with tied embeddings store no lm_head; untied ones do.
        weights["lm_head.weight"] = normal(vocab_size, embed_dim, std=0.1)
    return weights


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _check_shape(*, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> int:
    """The head dim (``embed_dim // num_heads`` unless given); ValueError if unusable."""
    if head_dim is None:
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        head_dim = embed_dim // num_heads
    if head_dim < 64:
        raise ValueError(
            f"head dim {head_dim} is below 64, which vLLM's CPU attention does not support; "
            "lower num_heads or raise embed_dim (or head_dim)"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    return head_dim


def _check_vocab_size(vocab_size: int, special_tokens: tuple[str, ...]) -> None:
    min_vocab = 256 + len(special_tokens)
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be at least {min_vocab}: 256 byte tokens plus "
            f"the special tokens {special_tokens}"
        )


def _added_tokens_decoder(special_ids: dict[str, int]) -> dict[str, dict[str, Any]]:
    """``tokenizer_config.json``'s description of the special tokens."""
    return {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in special_ids.items()
    }


def _chatml_tokenizer_config(
    special_ids: dict[str, int],
    max_seq_len: int,
    chat_template: str = CHATML_TEMPLATE,
    extra_ids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``tokenizer_config.json`` of Qwen2 and Qwen3: ChatML, eos ``<|im_end|>``, no bos."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            **_added_tokens_decoder(special_ids),
            **{
                str(token_id): {**entry, "special": False}
                for token_id, entry in _added_tokens_decoder(extra_ids or {}).items()
            },
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_seq_len,
        "split_special_tokens": False,
    }


def _write_model_folder(
    out_dir: str | os.PathLike,
    *,
    config: dict[str, Any],
    generation_config: dict[str, Any],
    tokenizer: Tokenizer,
    tokenizer_config: dict[str, Any],
    weights: dict[str, torch.Tensor],
) -> Path:
    """Write a Hugging Face model folder to a temporary sibling, then rename it into place
    (replacing an existing ``out_dir``; a failure leaves nothing behind)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "generation_config.json", generation_config)
        _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config)
        (tmp_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
        tokenizer.model.save(str(tmp_dir))  # vocab.json + merges.txt (what torchtune reads)
        save_file(weights, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        tmp_dir.chmod(0o755)  # mkdtemp creates 0o700
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def build_tiny_qwen2(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    embed_dim: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_dim: int = 256,
    vocab_size: int = 512,
    max_seq_len: int = 2048,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tool_calls: bool = False,
) -> Path:
    """Write a tiny random Qwen2 checkpoint with a trained byte-level BPE tokenizer.

    The tokenizer holds BPE tokens followed by ``<|endoftext|>`` (pad), ``<|im_start|>`` and
    ``<|im_end|>`` (eos); embedding rows after them are unused padding, as in real Qwen2.

    Args:
        out_dir (str | os.PathLike): Folder to create (an existing one is replaced).
        num_heads (int): Number of query heads; the head dim ``embed_dim // num_heads`` must be
            64 or more for vLLM's CPU attention.
        tool_calls (bool): Qwen2.5's tool calling: ``<tool_call>`` and ``</tool_call>`` are
            tokens of their own and the chat template renders tools as Qwen2.5's does.

    Returns:
        Path: ``out_dir``.

    Raises:
        ValueError: If a dimension is inconsistent (heads do not divide ``embed_dim``, head dim
            below 64, ``num_kv_heads`` does not divide ``num_heads``) or ``vocab_size`` cannot
            hold the byte alphabet and the special tokens.
    """
    head_dim = _check_shape(
        embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=None
    )
    _check_vocab_size(vocab_size, SPECIAL_TOKENS)
    extra_tokens = TOOL_CALL_TOKENS if tool_calls else ()
    tokenizer = _train_tokenizer(
        bpe_vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(extra_tokens),
        extra_tokens=extra_tokens,
    )
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    weights = _init_weights(
        num_layers=num_layers,
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_dim=intermediate_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
    )
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[ENDOFTEXT],
        "eos_token_id": special_ids[IM_END],
        "hidden_act": "silu",
        "hidden_size": embed_dim,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_dim,
        "max_position_embeddings": max_seq_len,
        "max_window_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": max_seq_len,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    generation_config = {
        "bos_token_id": special_ids[ENDOFTEXT],
        # vLLM stops on every id listed here, so generation ends at either token.
        "eos_token_id": [special_ids[IM_END], special_ids[ENDOFTEXT]],
        "pad_token_id": special_ids[ENDOFTEXT],
    }
    return _write_model_folder(
        out_dir,
        config=config,
        generation_config=generation_config,
        tokenizer=tokenizer,
        tokenizer_config=_chatml_tokenizer_config(
            special_ids,
            max_seq_len,
            TOOL_CHATML_TEMPLATE if tool_calls else CHATML_TEMPLATE,
            {token: tokenizer.token_to_id(token) for token in extra_tokens},
        ),
        weights=weights,
    )


def build_tiny_qwen3(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    embed_dim: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_dim: int = 256,
    vocab_size: int = 512,
    max_seq_len: int = 2048,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen3 (dense) checkpoint with Qwen2's tokenizer.

    Like `build_tiny_qwen2` with Qwen3's architecture. The default ``head_dim`` (64) is twice
    ``embed_dim // num_heads``, as in Qwen3-0.6B, so loaders that derive the head dim from the
    hidden size fail.

    Raises:
        ValueError: If ``head_dim`` is below 64, ``num_kv_heads`` does not divide
            ``num_heads``, or ``vocab_size`` cannot hold the bytes and special tokens.
    """
    _check_shape(
        embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    _check_vocab_size(vocab_size, SPECIAL_TOKENS)
    tokenizer = _train_tokenizer(bpe_vocab_size=vocab_size - len(SPECIAL_TOKENS))
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    weights = _init_weights(
        num_layers=num_layers,
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_dim=intermediate_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
        qkv_bias=False,
        qk_norm=True,
    )
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[ENDOFTEXT],
        "eos_token_id": special_ids[IM_END],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": embed_dim,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_dim,
        "max_position_embeddings": max_seq_len,
        "max_window_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    generation_config = {
        "bos_token_id": special_ids[ENDOFTEXT],
        "eos_token_id": [special_ids[IM_END], special_ids[ENDOFTEXT]],
        "pad_token_id": special_ids[ENDOFTEXT],
    }
    return _write_model_folder(
        out_dir,
        config=config,
        generation_config=generation_config,
        tokenizer=tokenizer,
        tokenizer_config=_chatml_tokenizer_config(special_ids, max_seq_len),
        weights=weights,
    )


def build_tiny_llama(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    embed_dim: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_dim: int = 256,
    vocab_size: int = 512,
    max_seq_len: int = 2048,
    rope_theta: float = 500_000.0,
    rope_scaling: dict[str, Any] | None = TINY_LLAMA_ROPE_SCALING,
    rms_norm_eps: float = 1e-5,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Path:
    """Write a tiny random Llama 3.2-style checkpoint with a Llama 3-style tokenizer.

    Llama 3.2's architecture (``rope_type: llama3`` scaling, tied embeddings by default) and
    Llama 3's tokenizer: its pre-tokenizer and special tokens, a bos prepended by the
    post-processor, ``<|eot_id|>`` as eos and no pad token.

    Args:
        rope_scaling (dict[str, Any] | None): ``rope_scaling`` of the config (default
            `TINY_LLAMA_ROPE_SCALING`); None for Llama 3.0's plain RoPE.

    Raises:
        ValueError: If a dimension is inconsistent (see `build_tiny_qwen2`) or ``vocab_size``
            cannot hold the bytes and special tokens.
    """
    head_dim = _check_shape(
        embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=None
    )
    _check_vocab_size(vocab_size, LLAMA3_SPECIAL_TOKENS)
    tokenizer = _train_tokenizer(
        bpe_vocab_size=vocab_size - len(LLAMA3_SPECIAL_TOKENS),
        special_tokens=LLAMA3_SPECIAL_TOKENS,
        pretokenize_regex=LLAMA3_PRETOKENIZE_REGEX,
        bos_token=BEGIN_OF_TEXT,
    )
    special_ids = {token: tokenizer.token_to_id(token) for token in LLAMA3_SPECIAL_TOKENS}
    weights = _init_weights(
        num_layers=num_layers,
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_dim=intermediate_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
        qkv_bias=False,
    )
    stop_ids = [special_ids[END_OF_TEXT], special_ids[EOT_ID]]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[BEGIN_OF_TEXT],
        "eos_token_id": stop_ids,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": embed_dim,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_dim,
        "max_position_embeddings": max_seq_len,
        "mlp_bias": False,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": rms_norm_eps,
        "rope_scaling": dict(rope_scaling) if rope_scaling is not None else None,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    generation_config = {"bos_token_id": special_ids[BEGIN_OF_TEXT], "eos_token_id": stop_ids}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(special_ids),
        "bos_token": BEGIN_OF_TEXT,
        "eos_token": EOT_ID,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        # Real Llama 3 sets true; false keeps decode(encode(text)) == text exactly.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_seq_len,
    }
    return _write_model_folder(
        out_dir,
        config=config,
        generation_config=generation_config,
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        weights=weights,
    )


def tiny_vllm_engine_kwargs(
    *, max_model_len: int = 1024, kv_cache_mib: int = 64, seed: int = 0
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that run a tiny model on a small CPU machine.

    Call `set_vllm_cpu_env` in the process before constructing the engine.

    ``kv_cache_mib``: the tiny model needs 1 KiB per token, so 64 MiB holds 64k tokens.
    """
    return {
        "dtype": "float32",
        # Eager mode: no torch.compile (minutes on 2 cores) and no graph capture.
        "enforce_eager": True,
        "max_model_len": max_model_len,
        # On CPU this is the fraction of host memory vLLM checks as available at start-up;
        # the KV cache itself is sized by kv_cache_memory_bytes.
        "gpu_memory_utilization": 0.05,
        "kv_cache_memory_bytes": kv_cache_mib * 2**20,
        "max_num_seqs": 64,
        "seed": seed,
        "tensor_parallel_size": 1,
    }


def set_vllm_cpu_env() -> None:
    """Set the environment vLLM's CPU backend needs to start fast in the current process.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this process (no worker
    process to spawn at start-up). Existing values are kept.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def make_fake_model_dir(folder: str | os.PathLike, max_position_embeddings: int = 512) -> Path:
    """A folder that passes the model-folder checks of config validation, without real weights.

    For tests that check a model folder's files but never load them.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2", "max_position_embeddings": max_position_embeddings}
    _write_json(folder / "config.json", config)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder
