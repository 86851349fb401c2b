"""DeepSeek's control tokens, and a text encoder that can never produce one.

A control token (``<｜User｜>``, ``</think>``, the tool-call markers, BOS/EOS ...) changes how the
model reads everything after it, so only the chat template may insert one. Text that comes from a
user, a tool or a document is encoded by :class:`PlainTextEncoder`: a copy of the model's tokenizer
in which every control token is marked special and special-token matching is switched off, so the
characters ``<｜User｜>`` in a user message become ordinary byte-level tokens.

Marking them special matters: ``tokenizers`` only skips *special* added tokens when
``encode_special_tokens`` is on, and DeepSeek ships ``<think>``/``</think>`` and the tool markers as
non-special added tokens.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer

from deepinfer.tokenizer import Tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"

#: Every marker of DeepSeek's chat format (V3 and V3.1). Those the tokenizer knows are control tokens.
MARKERS = (
    BOS,
    EOS,
    USER,
    ASSISTANT,
    THINK_BEGIN,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜▁pad▁｜>",
)

THINKING_MARKERS = (THINK_BEGIN, THINK_END)
TOOL_MARKERS = (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP)
TOOL_OUTPUT_MARKERS = (TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END)


@dataclass(frozen=True, slots=True)
class ControlTokens:
    """The control tokens of one tokenizer: marker text -> id, and the set of all control ids
    (DeepSeek's markers it knows, its BOS/EOS, and every token it declares special)."""

    ids: dict[str, int]
    all_ids: frozenset[int]
    texts: tuple[str, ...]  # the text of every control token, for tests and diagnostics

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ControlTokens:
        backend = tokenizer.backend
        ids = {m: i for m in MARKERS if (i := backend.token_to_id(m)) is not None}
        if tokenizer.bos_token and tokenizer.bos_token_id is not None:
            ids.setdefault(BOS, tokenizer.bos_token_id)
        if tokenizer.eos_token and tokenizer.eos_token_id is not None:
            ids.setdefault(EOS, tokenizer.eos_token_id)
        special = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
        texts = {**{i: m for m, i in ids.items()}, **special}
        return cls(ids=ids, all_ids=frozenset(texts), texts=tuple(texts.values()))

    def has(self, *markers: str) -> bool:
        return all(m in self.ids for m in markers)

    def __getitem__(self, marker: str) -> int:
        try:
            return self.ids[marker]
        except KeyError:
            raise KeyError(f"the tokenizer has no {marker!r} token") from None


class PlainTextEncoder:
    """Encodes untrusted text as plain text: control-token strings inside it become ordinary tokens.

    Built from the model's tokenizer; thread-safe (``tokenizers`` encodes without shared state).
    ``encode_batch`` encodes several pieces in parallel (Rust threads, GIL released).
    """

    def __init__(self, tokenizer: Tokenizer, control: ControlTokens) -> None:
        config = json.loads(tokenizer.backend.to_str())
        for added in config.get("added_tokens", []):
            if added["id"] in control.all_ids:
                added["special"] = True
        self._tok = HFTokenizer.from_str(json.dumps(config))
        self._tok.encode_special_tokens = True
        self.control_ids = control.all_ids
        leaks = {
            text: ids
            for text, ids in zip(control.texts, self.encode_batch(list(control.texts)))
            if not self.control_ids.isdisjoint(ids)
        }
        if leaks:  # a vocabulary whose plain BPE pieces are control ids cannot be made safe
            raise ValueError(f"the tokenizer encodes control-token text to control ids: {leaks}")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]


_ENCODERS: weakref.WeakKeyDictionary[Tokenizer, PlainTextEncoder] = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def plain_text_encoder(tokenizer: Tokenizer) -> PlainTextEncoder:
    """The (cached, built once per tokenizer) :class:`PlainTextEncoder` of ``tokenizer``: what the chat
    recipe encodes message text with, and ``/v1/completions`` raw prompts unless a request asks for
    control-token parsing. Raises ``ValueError`` as the encoder does."""
    with _ENCODERS_LOCK:
        encoder = _ENCODERS.get(tokenizer)
        if encoder is None:
            encoder = _ENCODERS[tokenizer] = PlainTextEncoder(tokenizer, ControlTokens.of(tokenizer))
        return encoder
