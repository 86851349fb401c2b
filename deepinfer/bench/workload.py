"""A seeded benchmark workload: prompts cut from held-out stdlib code, fixed output lengths.

Prompts are token ids (so every engine, ours or a peer, gets exactly the same input): windows of a
token stream made of the held-out files, with lengths drawn uniformly from ``input_len_range``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from deepinfer.bench.corpus import heldout_files
from deepinfer.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int = 64
    input_len_range: tuple[int, int] = (64, 1024)
    output_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.input_len_range
        if self.num_requests < 1 or self.output_len < 1 or not 1 <= lo <= hi:
            raise ValueError(
                f"invalid workload {self}: need requests >= 1, output_len >= 1, 1 <= min <= max length"
            )

    def prompts(self, tokenizer: Tokenizer) -> list[list[int]]:
        stream = heldout_stream(tokenizer)
        lo, hi = self.input_len_range
        if hi >= len(stream):
            raise ValueError(f"input length {hi} exceeds the held-out token stream ({len(stream)} tokens)")
        rng = random.Random(self.seed)
        prompts = []
        for _ in range(self.num_requests):
            length = rng.randint(lo, hi)
            start = rng.randrange(len(stream) - length)
            prompts.append(stream[start : start + length])
        return prompts

    def describe(self) -> dict:
        return asdict(self)


_streams: dict[int, list[int]] = {}


def heldout_stream(tokenizer: Tokenizer) -> list[int]:
    """All held-out files, tokenized and concatenated (cached per tokenizer)."""
    key = id(tokenizer)
    if key not in _streams:
        texts = [text for _, text in heldout_files()]
        encoded = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
        _streams[key] = [t for e in encoded for t in e.ids]
    return _streams[key]
