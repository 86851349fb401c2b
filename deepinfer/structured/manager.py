"""Per-request grammar matchers and the step's token bitmask.

Owned by the engine: matchers are created when a constrained request is added (an invalid constraint
is rejected there, before any work), advanced over every token the request emits, and dropped when it
finishes. The model runner asks for the bitmask of a step's sampled rows before running the model;
the masks are computed on a helper thread (the backend releases the GIL) while the forward pass runs.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.backend import GrammarBackend, GrammarError, LLGuidanceBackend
from deepinfer.structured.constraint import Constraint
from deepinfer.tokenizer import Tokenizer


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.matchers: dict[str, Any] = {}
        self.mask_seconds = 0.0  # time spent filling masks (on the helper thread)
        self.mask_rows = 0

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if self._tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer.json")
            self._backend = LLGuidanceBackend(self._tokenizer.backend.to_str(), self.vocab_size, self._eos)
        return self._backend

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Create the request's matcher if it is constrained; raises GrammarError (a ValueError) for a
        constraint the backend cannot compile, whatever the backend raised."""
        constraint = Constraint.of(params)
        if constraint is None:
            return
        backend = self.backend
        try:
            self.matchers[request_id] = backend.matcher(constraint)
        except GrammarError:
            raise
        except Exception as exc:  # the grammar library's own errors on odd input are still bad input
            raise GrammarError(
                f"{constraint.kind} could not be compiled: {type(exc).__name__}: {exc}"
            ) from exc

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, request_id: str, tokens: list[int]) -> None:
        matcher = self.matchers.get(request_id)
        if matcher is not None:
            self.backend.consume(matcher, tokens)

    def valid_drafts(self, request_id: str, emitted: list[int], drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the request's grammar accepts after its current state and
        then ``emitted`` (this step's tokens, not yet consumed): drafts the grammar forbids could never
        be accepted, so they are not verified. Unconstrained requests keep all their drafts."""
        matcher = self.matchers.get(request_id)
        if matcher is None or not drafts:
            return drafts
        valid = self.backend.valid_prefix(matcher, [*emitted, *drafts]) - len(emitted)
        return drafts[: max(0, valid)]

    def start_masks(
        self, rows: list[tuple[str, int, list[int]]], num_rows: int
    ) -> Future[torch.Tensor] | None:
        """Begin computing the bitmask of ``num_rows`` sampled rows: for each (request, first row,
        drafts) of a constrained request, its current mask and the masks after each draft. Rows of
        unconstrained requests allow everything. None when no row is constrained."""
        work = [(self.matchers[rid], first, drafts) for rid, first, drafts in rows if rid in self.matchers]
        if not work:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-grammar")
        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        return self._pool.submit(self._fill, work, bitmask)

    def _fill(self, work: list[tuple[Any, int, list[int]]], bitmask: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.backend.fill(work, bitmask)
        self.mask_seconds += time.perf_counter() - start
        self.mask_rows += sum(1 + len(d) for _, _, d in work)
        return bitmask
