"""Checks of the teacher a config names for on-policy distillation (``ref.teacher_model_path``).

The teacher scores the token ids the policy sampled, so the two tokenizers must map every id
to the same token: the same vocabulary, the same added (special) tokens at the same ids, and
the same eos. Only the tokenizer files are compared, not ``config.json``'s ``vocab_size``:
checkpoints of one family pad their embeddings to different sizes, and the rows past the
tokenizer's are never sampled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.choices import MODEL_TYPES
from grpo.config import resolve_path
from grpo.preflight.files import MODEL_FILES

KEY = "ref.teacher_model_path"


def teacher_problems(values: dict, this_machine: bool = True) -> list[str]:
    """Problems of the teacher folder: missing, incomplete, or a tokenizer not the policy's.

    Args:
        this_machine (bool): The run starts here: the folder must hold the weights and a
            tokenizer like the policy's. False (planning a run elsewhere): only its
            ``config.json``, which the memory plan reads.

    Returns:
        list[str]: Each problem as ``ref.teacher_model_path: what is wrong``; at most one.
    """
    ref = values.get("ref")
    path = ref.get("teacher_model_path") if isinstance(ref, dict) else None
    if not isinstance(path, str) or not path.strip():
        return []
    folder = resolve_path(path, fall_back_to_repo=True)
    if not folder.is_dir():
        return [f"{KEY}: teacher folder {folder} does not exist"]
    needed = MODEL_FILES if this_machine else ("config.json",)
    missing = [name for name in needed if not (folder / name).is_file()]
    if this_machine and not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        return [
            f"{KEY}: {folder} lacks {', '.join(missing)} (expected a Hugging Face model folder)"
        ]
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        return [f"{KEY}: {folder / 'config.json'} is not valid JSON: {exc}"]
    if model_type is not None and model_type not in MODEL_TYPES:
        return [
            f"{KEY}: {folder / 'config.json'} has model_type {model_type!r}; supported model "
            f"types: {', '.join(MODEL_TYPES)}"
        ]
    policy = values.get("base_model_path")
    if not this_machine or not isinstance(policy, str) or not policy:
        return []
    policy_folder = resolve_path(policy, fall_back_to_repo=True)
    if not (policy_folder / "tokenizer.json").is_file():
        return []  # reported as base_model_path's own problem
    try:
        difference = tokenizer_difference(policy_folder, folder)
    except (OSError, ValueError) as exc:
        return [f"{KEY}: cannot read the teacher's or the policy's tokenizer files: {exc}"]
    if difference is None:
        return []
    return [
        f"{KEY}: the teacher's tokenizer is not the policy's (base_model_path): {difference}; "
        "the teacher scores the token ids the policy sampled, so both must map every id to "
        "the same token"
    ]


def tokenizer_difference(policy_dir: Path, teacher_dir: Path) -> str | None:
    """The first way the teacher's tokenizer differs from the policy's, or None.

    Compared, in order: the vocabulary's size (regular plus added tokens), the added tokens
    and whether each is special, the eos token, then the regular vocabulary token by token.

    Returns:
        str | None: What differs, naming a token and both values; None when they agree.

    Raises:
        OSError: If a ``tokenizer.json`` cannot be read.
        ValueError: If one is not valid JSON.
    """
    policy, teacher = _tokenizer_files(policy_dir), _tokenizer_files(teacher_dir)
    policy_size, teacher_size = len(_ids(policy)), len(_ids(teacher))
    if policy_size != teacher_size:
        return f"its vocabulary has {teacher_size} tokens, the policy's {policy_size}"
    for content in sorted(policy["added"].keys() | teacher["added"].keys()):
        mine, theirs = policy["added"].get(content), teacher["added"].get(content)
        if mine != theirs:
            return (
                f"added token {content!r} is {_described(theirs)} in the teacher's, "
                f"{_described(mine)} in the policy's"
            )
    if policy["eos"] != teacher["eos"]:
        return f"its eos token is {teacher['eos']!r}, the policy's {policy['eos']!r}"
    if policy["vocab"] != teacher["vocab"]:
        for token in sorted(policy["vocab"].keys() | teacher["vocab"].keys()):
            mine, theirs = policy["vocab"].get(token), teacher["vocab"].get(token)
            if mine != theirs:
                return (
                    f"token {token!r} has id {theirs} in the teacher's vocabulary and {mine} "
                    "in the policy's"
                )
    return None


def _tokenizer_files(folder: Path) -> dict[str, Any]:
    """The vocabulary, the added tokens (content -> (id, special)) and the eos of a folder."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
        vocab = {piece[0]: index for index, piece in enumerate(vocab)}
    added = {
        token["content"]: (token["id"], bool(token.get("special")))
        for token in tokenizer.get("added_tokens") or []
    }
    eos = None
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        eos = json.loads(config_path.read_text()).get("eos_token")
        if isinstance(eos, dict):  # {"content": ..., "lstrip": ...}
            eos = eos.get("content")
    return {"vocab": vocab, "added": added, "eos": eos}


def _ids(files: dict[str, Any]) -> set[int]:
    return set(files["vocab"].values()) | {token_id for token_id, _ in files["added"].values()}


def _described(entry: tuple[int, bool] | None) -> str:
    if entry is None:
        return "absent"
    token_id, special = entry
    return f"id {token_id} ({'special' if special else 'not special'})"
