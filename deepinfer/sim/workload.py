"""Workload specs and the request traces they generate.

A workload is a set of traffic classes (chat, agent, code, ...). Each class starts *sessions* as a
Poisson process whose rate follows a 24-hour time-of-day profile; a session's first request arrives
at its start and every later turn after a gap drawn from ``revisit_gap_s`` (minutes for an agent
loop, hours for a chat user coming back). A turn's prompt is the class's shared system prefix (one
of ``system_prompts``, picked by a Zipf popularity), then the session's whole history (every earlier
turn's input and output), then the turn's new input. Nothing here says how often the cache hits:
that emerges from this structure and from the retention policy and capacity the simulator runs.

Prompts are described as *segments* (the system prefix, then one segment per earlier turn, then the
new input): each has a key that names its content and its position in the chain, and a token count.
Token ids are derived from the key, so equal prefixes hash to equal KV blocks in the engine's cache.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
import statistics
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_VOCAB = 1 << 20  # synthetic token ids: any value works, the engine's prefix cache only hashes them


class LengthDist(BaseModel):
    """A token-count (or seconds) distribution: fixed, uniform [low, high], exponential or lognormal
    (given by its mean and the sigma of the log); samples are clipped to [low, high]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["fixed", "uniform", "exponential", "lognormal"] = "fixed"
    mean: float | None = Field(None, gt=0, allow_inf_nan=False)
    sigma: float = Field(1.0, gt=0)
    low: float = Field(1, ge=0)
    high: float = Field(float("inf"), gt=0)

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.kind in ("fixed", "exponential", "lognormal") and self.mean is None:
            raise ValueError(f"a {self.kind} distribution needs 'mean'")
        if self.kind == "uniform" and not math.isfinite(self.high):
            raise ValueError("a uniform distribution needs a finite 'high'")
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) exceeds high ({self.high})")
        return self

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            value = rng.uniform(self.low, self.high)
        elif self.kind == "exponential":
            value = rng.expovariate(1 / self.mean)
        else:
            value = rng.lognormvariate(math.log(self.mean) - self.sigma**2 / 2, self.sigma)
        return min(max(value, self.low), self.high)

    @property
    def expected(self) -> float:
        """The mean before clipping (uniform: the midpoint)."""
        return (self.low + self.high) / 2 if self.kind == "uniform" else self.mean


class TrafficClass(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    rate_per_s: float = Field(
        gt=0, allow_inf_nan=False, description="mean requests per second (at a time-of-day factor of 1)"
    )
    time_of_day: list[Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        None, min_length=24, max_length=24, description="24 hourly rate factors (UTC hours 0..23)"
    )
    system_prompts: int = Field(1, ge=1, description="distinct shared prefixes (system prompt, tools)")
    system_prompt_zipf: float = Field(1.0, ge=0, description="Zipf exponent of their popularity")
    system_prompt_tokens: LengthDist
    turns_per_session: float = Field(1.0, ge=1, allow_inf_nan=False, description="mean turns (geometric)")
    revisit_gap_s: LengthDist = LengthDist(kind="fixed", mean=60.0)
    input_tokens: LengthDist
    output_tokens: LengthDist
    ttl_s: float = Field(3 * 86400, gt=0, description="store retention of this class's KV")

    @model_validator(mode="after")
    def _check(self) -> TrafficClass:
        if self.time_of_day is not None and (min(self.time_of_day) < 0 or max(self.time_of_day) <= 0):
            raise ValueError(f"class {self.name!r}: time_of_day factors must be >= 0 and not all zero")
        return self

    def rate_at(self, t: float, start_hour: float) -> float:
        if self.time_of_day is None:
            return self.rate_per_s
        return self.rate_per_s * self.time_of_day[int(start_hour + t / 3600) % 24]

    @property
    def peak_factor(self) -> float:
        return max(self.time_of_day) if self.time_of_day else 1.0


class WorkloadSpec(BaseModel):
    """The traffic a deployment must serve (the planner's ``--workload W.yaml``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: list[TrafficClass] = Field(min_length=1)
    start_hour: float = Field(0.0, ge=0, lt=24, description="UTC hour at simulated time 0")

    @model_validator(mode="after")
    def _unique(self) -> WorkloadSpec:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"traffic class names must be unique, got {names}")
        return self

    @classmethod
    def load(cls, path: str | Path) -> WorkloadSpec:
        """The spec in a YAML file; a ValueError of one line names the file and what is wrong in it."""
        import yaml

        from deepinfer.sim.spec_errors import validation_problems, yaml_problem

        try:
            raw = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"workload file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"workload file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        except yaml.YAMLError as exc:
            raise ValueError(f"workload file {path} is not valid YAML: {yaml_problem(exc)}") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"invalid workload {path}: {validation_problems(exc, cls)}") from None

    @property
    def rate_per_s(self) -> float:
        return sum(c.rate_per_s for c in self.classes)

    @property
    def ttls(self) -> dict[str, float]:
        """Traffic class -> store TTL in seconds (the KV store's retention configuration)."""
        return {c.name: c.ttl_s for c in self.classes}


@dataclass(frozen=True, slots=True)
class Segment:
    key: tuple  # names the content and its place in the chain
    tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when it arrives, its class, its prompt (segments), and its output length. The
    last segment is the turn's new input; ``output_key`` names the output, which the session's next
    turn carries in its history together with that input."""

    time: float
    request_id: str
    traffic_class: str  # its TTL is the retention policy's (the class's ``ttl_s``)
    segments: tuple[Segment, ...]
    output_tokens: int
    explicit_prompt_ids: tuple[int, ...] | None = None  # a replayed real trace's prompt (segments: one)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    def token_ids(self) -> list[int]:
        if self.explicit_prompt_ids is not None:
            return list(self.explicit_prompt_ids)
        return list(itertools.chain.from_iterable(segment_token_ids(s) for s in self.segments))

    def output_token_ids(self) -> tuple[int, ...]:
        return segment_token_ids(Segment(("out", self.request_id), self.output_tokens))


@functools.lru_cache(maxsize=8192)  # a session's turns re-read its system prompt and earlier turns
def segment_token_ids(segment: Segment) -> tuple[int, ...]:
    """Deterministic synthetic ids for a segment's tokens (equal keys give equal ids). A past turn's
    ids are its input's followed by its output's, as the engine saw them."""
    key = segment.key
    if key[0] == "turn":
        _, input_key, input_tokens, request_id = key
        return segment_token_ids(Segment(input_key, input_tokens)) + segment_token_ids(
            Segment(("out", request_id), segment.tokens - input_tokens)
        )
    base = zlib.crc32(repr(key).encode()) % _VOCAB
    return tuple(((base + 7919 * np.arange(segment.tokens, dtype=np.int64)) % _VOCAB).tolist())


def arrivals(
    spec: WorkloadSpec, duration_s: float, seed: int = 0, share: float = 1.0, steady_state: bool = False
) -> Iterator[Arrival]:
    """The trace of ``duration_s`` seconds, in arrival order. ``share`` (0, 1] keeps that fraction of
    the sessions (every turn of a kept session), which is how one simulated replica gets its share
    of a cluster's traffic.

    By default no session is in progress at time 0, so a class with several turns a session reaches
    its request rate only after its revisit gaps have passed (hours for chat users). With
    ``steady_state`` the trace starts in the steady state instead: it first yields, at negative
    times, the last turn before 0 of every session in progress at 0 (:func:`_in_progress`; its
    prompt carries the session's earlier turns), each followed by its next turn after 0, so the
    request rate is the classes' from time 0 (a caller feeds the turns before 0 to its caches only).
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    rng = random.Random(seed)
    # (time, order, class index, class, turn, session, history, next turn's time if already known)
    heap: list[tuple[float, int, int, TrafficClass, int, tuple, tuple[Segment, ...], float | None]] = []
    counter = 0
    weights_cache: dict[str, list[float]] = {}
    for index, cls in enumerate(spec.classes):
        # Sessions start at rate / turns; thinning against the peak handles the time-of-day profile.
        peak = cls.rate_per_s * cls.peak_factor * share / cls.turns_per_session
        t = rng.expovariate(peak)
        heapq.heappush(heap, (t, counter, index, cls, -1, (), (), None))
        counter += 1
        if steady_state:
            for entry in _in_progress(spec, index, share, seed, weights_cache):
                heapq.heappush(heap, (entry[0], counter, index, cls, *entry[1:]))
                counter += 1
    while heap:
        t, _, index, cls, turn, session, history, next_time = heapq.heappop(heap)
        if t >= duration_s:
            continue
        if turn < 0:  # a session start candidate: schedule the next candidate, maybe start a session
            peak = cls.rate_per_s * cls.peak_factor * share / cls.turns_per_session
            heapq.heappush(heap, (t + rng.expovariate(peak), counter, index, cls, -1, (), (), None))
            counter += 1
            if rng.random() * cls.rate_per_s * cls.peak_factor > cls.rate_at(t, spec.start_hour):
                continue
            session, history, turn = (cls.name, counter), (_system_segment(cls, rng, weights_cache),), 0
            counter += 1
        new_input = Segment(("in", session, turn), max(1, round(cls.input_tokens.sample(rng))))
        output = max(1, round(cls.output_tokens.sample(rng)))
        request_id = f"{cls.name}-{session[1]}-{turn}"
        yield Arrival(t, request_id, cls.name, (*history, new_input), output)
        # The next turn: geometric number of turns with the class's mean (known for a session that
        # was in progress at time 0).
        if next_time is not None or rng.random() < 1 - 1 / cls.turns_per_session:
            turn_segment = Segment(
                ("turn", new_input.key, new_input.tokens, request_id), new_input.tokens + output
            )
            when = next_time if next_time is not None else t + cls.revisit_gap_s.sample(rng)
            heapq.heappush(
                heap, (when, counter, index, cls, turn + 1, session, (*history, turn_segment), None)
            )
            counter += 1


def _system_segment(cls: TrafficClass, rng: random.Random, weights_cache: dict[str, list[float]]) -> Segment:
    """A new session's shared prefix: one of the class's system prompts, by their Zipf popularity."""
    weights = weights_cache.setdefault(
        cls.name, [1 / (k + 1) ** cls.system_prompt_zipf for k in range(cls.system_prompts)]
    )
    prompt_id = rng.choices(range(cls.system_prompts), weights)[0]
    sys_rng = random.Random(f"{cls.name}/{prompt_id}")  # the same prefix has the same length
    return Segment(("sys", cls.name, prompt_id), max(1, round(cls.system_prompt_tokens.sample(sys_rng))))


#: Gaps drawn to sample the length-biased gap in progress (at least; 4x the sessions expected).
GAP_POOL = 10_000


def _in_progress(
    spec: WorkloadSpec, index: int, share: float, seed: int, weights_cache: dict[str, list[float]]
) -> list[tuple[float, int, tuple, tuple[Segment, ...], float]]:
    """The sessions of class ``index`` in progress at time 0 in the steady state, each as (time of
    its last turn before 0, that turn's index, session, history before that turn, time of its next
    turn after 0).

    A session in progress at 0 is one whose revisit gap spans 0. Gaps start at rate ``lam * (m - 1)``
    (``lam`` sessions a second, at the rate of time 0; ``m`` turns a session, so ``m - 1`` gaps), so
    the number spanning 0 is Poisson with mean ``lam * (m - 1) * E[gap]``; a spanning gap is drawn
    length-biased (in proportion to its length, from a pool of draws) and 0 falls uniformly inside
    it. The turns a session had completed are geometric with mean ``m`` (the turn count is
    memoryless); each earlier turn's input and output lengths are drawn as the class's."""
    cls = spec.classes[index]
    m = cls.turns_per_session
    lam = cls.rate_at(0.0, spec.start_hour) * share / m
    if m <= 1 or lam <= 0:
        return []
    rng = random.Random(f"{seed}/in-progress/{cls.name}")
    expected = lam * (m - 1) * cls.revisit_gap_s.expected
    pool = [cls.revisit_gap_s.sample(rng) for _ in range(max(GAP_POOL, 4 * math.ceil(expected)))]
    count = int(np.random.default_rng(rng.getrandbits(63)).poisson(lam * (m - 1) * statistics.fmean(pool)))
    out = []
    for i, gap in enumerate(rng.choices(pool, weights=pool, k=count)):
        after = rng.random() * gap  # the next turn comes this long after 0
        done = 1
        while rng.random() < 1 - 1 / m:
            done += 1
        session = (cls.name, f"p{i}")
        history: tuple[Segment, ...] = (_system_segment(cls, rng, weights_cache),)
        for turn in range(done - 1):
            new_input = Segment(("in", session, turn), max(1, round(cls.input_tokens.sample(rng))))
            output = max(1, round(cls.output_tokens.sample(rng)))
            request_id = f"{cls.name}-{session[1]}-{turn}"
            history += (
                Segment(("turn", new_input.key, new_input.tokens, request_id), new_input.tokens + output),
            )
        out.append((after - gap, done - 1, session, history, after))
    return out
