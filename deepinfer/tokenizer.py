"""The tokenizer of a model folder: ``tokenizer.json`` through the ``tokenizers`` library, plus the
special-token settings of ``tokenizer_config.json`` (BOS handling, chat template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from deepinfer.text_input import require_valid_text


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (needed to turn text into tokens)")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template: str | None = self.config.get("chat_template")
        self.special_token_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` a BOS is prepended when the tokenizer's
        config asks for one (and its post-processor did not already add it). Text with a lone surrogate
        raises InvalidTextError (a ValueError); callers that know the field name check it first."""
        ids = self._tok.encode(require_valid_text(text, "text"), add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding and grammar libraries)."""
        return self._tok
