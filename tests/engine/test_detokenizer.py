"""Incremental detokenization never splits a multi-byte character and adds up to the full decode."""

from __future__ import annotations

from pathlib import Path

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.tokenizer import Tokenizer

TEXT = "print('héllo wörld ✓ 日本語 🙂🙂') # ünïcödé ∑ 𝔘"


def test_streamed_deltas_are_whole_characters_and_sum_to_the_text(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    prompt = tok.encode("x = ")
    ids = tok.encode(TEXT, add_special_tokens=False)
    # byte-level BPE splits the rare characters into several byte tokens: the hard case
    assert len(ids) > len(TEXT) // 2
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text
    assert any(d == "" for d in deltas)  # some tokens completed no character


def test_an_unfinished_character_is_flushed_as_replacement(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped_or_kept(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    eos = tok.eos_token_id
    ids = [*tok.encode("ab", add_special_tokens=False), eos]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for t in ids:
        skip.add(t)
        keep.add(t)
    assert skip.text == "ab" and keep.text == "ab" + tok.eos_token
    assert tok.encode("ab")[0] == tok.bos_token_id
