"""Predicted time of an engine step, from its tokens and its attention work.

A step computes, for each request, ``n`` new tokens on top of ``c`` cached ones. Its time is modelled as

    t = overhead + per_request * requests + per_token * sum(n) + per_attention * sum(n * c + n * (n + 1) / 2)
        + per_context * sum(c over chunks, n > 1)

the linear layers cost in proportion to tokens, attention in proportion to (query token, key token)
pairs, and a prompt chunk after a cached context also pays for reading that context back and expanding
it into per-head keys and values (MLA's prefill form), in proportion to its length. (Drafts being
verified, n = 2..1+k, are computed in the absorbed form and do not pay it; the model counts them as
chunks, which errs on the safe side.) Coefficients come from a short calibration on the real model at
startup (least squares on relative error over a few synthetic steps), or from the chip's facts table
when calibration is off. The scheduler uses the
model to cut prompt chunks to a time budget instead of a fixed size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from deepinfer.model.config import ModelConfig
from deepinfer.platform.chips import ChipFacts

Work = tuple[int, int]  # (new tokens, cached tokens) of one request in a step


def attention_pairs(num_new: int, num_cached: int) -> float:
    """(query, key) pairs a causal chunk of ``num_new`` tokens after ``num_cached`` ones attends."""
    return num_new * num_cached + num_new * (num_new + 1) / 2


@dataclass(frozen=True, slots=True)
class StepCostModel:
    overhead_s: float
    per_request_s: float
    per_token_s: float
    per_attention_s: float
    per_context_s: float
    source: str  # "calibrated" or "chip facts"

    VERSION: ClassVar[int] = 2  # of the terms above; stored calibrations of another version are redone

    def predict(self, work: Sequence[Work]) -> float:
        """Seconds for a step computing ``work`` (one (new, cached) pair per request)."""
        return (
            self.overhead_s
            + self.per_request_s * len(work)
            + self.per_token_s * sum(n for n, _ in work)
            + self.per_attention_s * sum(attention_pairs(n, c) for n, c in work)
            + self.per_context_s * sum(c for n, c in work if n > 1)
        )

    def marginal(self, num_new: int, num_cached: int) -> float:
        """Seconds one more request of ``num_new`` tokens after ``num_cached`` adds to a step."""
        return (
            self.per_request_s
            + self.per_token_s * num_new
            + self.per_attention_s * attention_pairs(num_new, num_cached)
            + self.per_context_s * num_cached * (num_new > 1)
        )

    def largest_chunk(self, num_cached: int, seconds: float, limit: int) -> int:
        """The most new tokens (<= limit) one request can add after ``num_cached`` within ``seconds``."""
        budget = seconds - self.per_request_s - self.per_context_s * num_cached
        # per_attention/2 * n^2 + (per_token + per_attention * (c + 1/2)) * n - budget <= 0
        a = self.per_attention_s / 2
        b = self.per_token_s + self.per_attention_s * (num_cached + 0.5)
        if budget <= 0:  # the request's own overhead and context read already overrun the time left
            n = 0
        else:
            n = int(budget / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        if n < 2:  # a lone token skips the context expansion (absorbed form)
            n = int(self.marginal(1, num_cached) <= seconds)
        return max(0, min(limit, n))

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[Work], float]]) -> StepCostModel:
        """Least-squares fit of the relative error (coefficients clamped at zero) to measured
        (work, seconds) samples, so that short steps are predicted as well as long ones."""
        x, y = _design(samples)
        coef = _nonnegative_least_squares(x / y[:, None], np.ones_like(y))
        return cls(*(float(v) for v in coef), source="calibrated")

    @classmethod
    def fit_mean(cls, samples: Sequence[tuple[Sequence[Work], float]], source: str) -> StepCostModel:
        """Least-squares fit of the *expected* time of noisy measured steps (a served engine's on a
        shared host), each weighted by the inverse square of its predicted time: iteratively
        reweighted from :meth:`fit`. Dividing by the measured time itself, as :meth:`fit` does, biases
        the model low when the same step's time varies (the long measurements weigh least), which a
        simulated clock must not be."""
        x, y = _design(samples)
        model = cls.fit(samples)
        for _ in range(5):
            predicted = np.maximum(x @ np.array(model._coefficients()), 1e-9)
            coef = _nonnegative_least_squares(x / predicted[:, None], y / predicted)
            model = cls(*(float(v) for v in coef), source=source)
        return cls(*model._coefficients(), source=source)

    def _coefficients(self) -> tuple[float, float, float, float, float]:
        return (
            self.overhead_s,
            self.per_request_s,
            self.per_token_s,
            self.per_attention_s,
            self.per_context_s,
        )

    @classmethod
    def from_chip(cls, chip: ChipFacts, config: ModelConfig, efficiency: float = 0.4) -> StepCostModel:
        """An analytic model: 2 FLOPs per active parameter per token, MLA's attention FLOPs per pair,
        both at ``efficiency`` of the chip's dense bf16 rate."""
        flops_per_s = chip.bf16_tflops * 1e12 * efficiency
        d, h = config.hidden_size, config.num_attention_heads
        experts = config.num_experts_per_tok + config.n_shared_experts if config.n_routed_experts else 0
        mlp = 3 * d * (config.moe_intermediate_size * experts if experts else config.intermediate_size)
        attn_proj = d * (config.q_lora_rank or 0) + h * config.qk_head_dim * (config.q_lora_rank or d)
        attn_proj += d * (config.kv_lora_rank + config.qk_rope_head_dim) + h * config.v_head_dim * d
        per_token = 2 * config.num_hidden_layers * (mlp + attn_proj) + 2 * d * config.vocab_size
        per_pair = 2 * config.num_hidden_layers * h * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
        per_context = (
            2
            * config.num_hidden_layers
            * config.kv_lora_rank
            * h
            * (config.qk_nope_head_dim + config.v_head_dim)
        )
        return cls(
            1e-3,
            1e-5,
            per_token / flops_per_s,
            per_pair / flops_per_s,
            per_context / flops_per_s,
            "chip facts",
        )

    # ------------------------------------------------------------------ persistence
    def save(self, path: Path) -> None:
        """Write to ``path`` atomically: a temporary file of this writer's own beside it, flushed to
        disk, then renamed over it. Engines calibrating at the same time (the workers of one local
        cluster) each replace the whole file; a reader sees one of their models, never a mix."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(asdict(self), indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: Path) -> StepCostModel:
        return cls(**json.loads(path.read_text()))


def _design(samples: Sequence[tuple[Sequence[Work], float]]) -> tuple[np.ndarray, np.ndarray]:
    """The terms of each sample's step (one row each, in the model's coefficient order) and its time."""
    rows = [
        [1.0, len(w), sum(n for n, _ in w), sum(attention_pairs(n, c) for n, c in w),
         sum(c for n, c in w if n > 1)]
        for w, _ in samples
    ]  # fmt: skip
    return np.array(rows), np.array([t for _, t in samples])


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative column and refit)."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            full = np.zeros(x.shape[1])
            full[active] = np.maximum(coef, 0)
            return full
        del active[int(np.argmin(coef))]
