"""A model folder's own tokenizer, the same one vLLM uses, for every model family.

vLLM tokenizes with ``transformers.AutoTokenizer`` on the model folder (``tokenizer.json``,
``tokenizer_config.json``). The actors that must agree with it token for token (the collector
that builds prompts, the reference and training actors that decode and pad) use the same files
through the same library, so prompt ids, special tokens and chat templates cannot drift apart
between families or versions. `Tokenizer` adds only what the actors need on top: bos/eos as
flags of ``encode``, the stop ids vLLM stops on (``generation_config.json``'s
``eos_token_id``), a pad id, and pickling by path so it can travel to Ray actors.
"""

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

    Args:
        model_dir (str | os.PathLike): Model folder with ``tokenizer.json`` (and usually
            ``tokenizer_config.json`` and ``generation_config.json``).

    Attributes:
        bos_id (int | None): Begin-of-text id, or None for families without one (Qwen).
        eos_id (int): The tokenizer's eos token id (``<|im_end|>`` for Qwen instruct models,
            ``<|eot_id|>`` for Llama 3 instruct).
        pad_id (int): Pad token id (the eos id when the tokenizer has no pad token, as in
            Llama 3; padding is masked out everywhere it is used).
        stop_tokens (list[int]): Ids generation stops on: ``generation_config.json``'s
            ``eos_token_id`` (what vLLM stops on), then ``eos_id`` if not among them.

    Raises:
        FileNotFoundError: If the folder or its ``tokenizer.json`` is missing.
        ValueError: If the tokenizer has no eos token.

    Example:
        >>> tokenizer = Tokenizer(model_dir)
        >>> ids = tokenizer.encode("What is 2 + 3?", add_eos=False)
        >>> tokenizer.decode(ids)
        'What is 2 + 3?'
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
        """Token ids of ``text``.

        Special-token strings in ``text`` (``<|im_start|>``) become their ids, as in vLLM.

        Args:
            text (str): The text.
            add_bos (bool): Start with the bos token when the model's tokenizer adds one by
                default (Llama 3) and ``text`` does not already begin with it (a rendered chat
                template does); no effect for tokenizers without bos (Qwen).
            add_eos (bool): End with ``eos_id``.

        Returns:
            list[int]: The ids.
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
            messages (list[dict[str, str]]): ``{"role", "content"}`` turns.
            add_generation_prompt (bool): End with the opening of the assistant's turn.
            tools (list[dict] | None): Tool schemas (JSON schema, as `grpo.envs.Tool.schema`
                writes them) the template lists in the family's own format.
            **chat_template_kwargs: Extra template variables (``enable_thinking=False``).

        Returns:
            str: The prompt text (it may start with the bos token, as Llama 3's does).

        Raises:
            ValueError: If the folder has no chat template, or rendering fails (the template's
                own error is included).
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
    """The tokenizer of a Hugging Face model folder (any supported family).

    Args:
        model_dir (str | os.PathLike): Model folder.

    Returns:
        Tokenizer: The tokenizer.

    Raises:
        FileNotFoundError: If the folder or its ``tokenizer.json`` is missing.
        ValueError: If the tokenizer has no eos token.

    Example:
        >>> tokenizer = load_tokenizer(model_dir)
        >>> prompt_ids = tokenizer.encode("What is 2 + 3?", add_eos=False)
    """
    return Tokenizer(model_dir)
