"""A model folder's own tokenizer: ``transformers.AutoTokenizer`` on the same files vLLM reads,
so the actors agree with vLLM token for token, plus bos/eos flags, stop ids, a pad id and
pickling by path."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo.models.hf_folder import model_folder, required_file

TOKENIZER_FILE = "tokenizer.json"


def _generation_eos_ids(model_dir: Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list), or [] without one."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from err
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(token_id, int) for token_id in ids):
        raise ValueError(
            f"{str(path)!r}: eos_token_id must be an int or a list of ints, got {eos!r}"
        )
    return ids


class Tokenizer:
    """The tokenizer of a Hugging Face model folder, with the interface the actors use.

    Attributes:
        bos_id (int | None): Begin-of-text id, or None for families without one (Qwen).
        pad_id (int): Pad token id (the eos id when the tokenizer has none, as in Llama 3).
        stop_tokens (list[int]): Ids generation stops on: ``generation_config.json``'s
            ``eos_token_id`` (what vLLM stops on), then ``eos_id`` if not among them.

    Raises:
        FileNotFoundError: If the folder or its ``tokenizer.json`` is missing.
        ValueError: If the tokenizer has no eos token.
    """

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.model_dir = model_folder(model_dir)
        required_file(self.model_dir, TOKENIZER_FILE, "tokenizer")
        self._load()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.hf_tokenizer = hf
        if hf.eos_token_id is None:
            raise ValueError(
                f"tokenizer of {str(self.model_dir)!r} has no eos token: set 'eos_token' in "
                "tokenizer_config.json"
            )
        self.eos_id: int = int(hf.eos_token_id)
        self.bos_id: int | None = None if hf.bos_token_id is None else int(hf.bos_token_id)
        self.pad_id: int = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_id
        stop_tokens = _generation_eos_ids(self.model_dir)
        self.stop_tokens: list[int] = stop_tokens + [self.eos_id] * (self.eos_id not in stop_tokens)
        # Whether the tokenizer itself starts a text with bos (Llama 3's post-processor does,
        # Qwen's does not): `encode(add_bos=True)` then does the same, and nothing otherwise.
        empty = hf.encode("", add_special_tokens=True)
        self._adds_bos = self.bos_id is not None and empty[:1] == [self.bos_id]

    def __getstate__(self) -> dict[str, Any]:
        # Ship the path, not the tokenizer object; the receiving process loads the same files.
        return {"model_dir": self.model_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_dir = state["model_dir"]
        self._load()

    @property
    def chat_template(self) -> str | None:
        """The folder's jinja chat template (``tokenizer_config.json``), or None."""
        return self.hf_tokenizer.chat_template

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings become their ids, as in vLLM.

        Args:
            add_bos (bool): Start with the bos token when the tokenizer adds one by default
                (Llama 3) and ``text`` does not already begin with it.
        """
        ids = self.hf_tokenizer.encode(text, add_special_tokens=False)
        if add_bos and self._adds_bos and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; special tokens kept unless ``skip_special_tokens=True``."""
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **chat_template_kwargs: Any,
    ) -> str:
        """Render chat turns with the folder's chat template, as transformers does.

        Args:
            tools (list[dict] | None): JSON tool schemas the template lists.

        Returns:
            str: The prompt text (it may start with the bos token).

        Raises:
            ValueError: If the folder has no chat template, or rendering fails.
        """
        if not self.chat_template:
            raise ValueError(
                f"model folder {str(self.model_dir)!r} has no chat template "
                "('chat_template' in tokenizer_config.json or chat_template.jinja)"
            )
        try:
            return self.hf_tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **chat_template_kwargs,
            )
        except Exception as err:  # jinja2 errors and the template's own raise_exception
            raise ValueError(
                f"chat template of {str(self.model_dir)!r} failed to render {messages!r}: "
                f"{type(err).__name__}: {err}"
            ) from err

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.model_dir)!r})"


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    """The `Tokenizer` of a Hugging Face model folder (any supported family).

    Raises:
        FileNotFoundError: If the folder or its ``tokenizer.json`` is missing.
        ValueError: If the tokenizer has no eos token.
    """
    return Tokenizer(model_dir)
