"""The typed messages between an API front and its engine cores (msgpack via msgspec).

Transport: the front binds one ZeroMQ ROUTER socket (a private ``ipc://`` endpoint per core, see
``deepinfer.core.client``); every core connects a DEALER whose identity is its ``engine_id``
(:func:`identity`), so one front can address several cores (data-parallel ranks, prefill or decode
workers) and each reply says which core sent it (the front drops a reply whose ``engine_id`` is not
its sender's). Front -> core:
:class:`AddRequest`, :class:`AbortRequests`, :class:`Shutdown`. Core -> front: :class:`Ready` once
(after the model loaded), then :class:`StepOutputs` (per-request token deltas, refusals and the
core's :class:`EngineStats`) and, if it fails, one :class:`CoreFailed` before it exits.

Everything is plain data: token ids, counts, strings of errors; never text to show a user, never a
pickled object. Times are ``time.monotonic()`` seconds of the host (cores on another host would have
to send durations instead). Sampling parameters travel as the JSON of the validated
``SamplingParams`` model, so there is one schema for them.
"""

from __future__ import annotations

import msgspec

from deepinfer.core.load import CostModel, EngineLoad


class AddRequest(msgspec.Struct, tag=True, frozen=True):
    """Admit one request (``params_json``: ``SamplingParams.model_dump_json()``). The core answers
    with its id in ``StepOutputs.accepted`` and then deltas, or with a :class:`Refusal`."""

    request_id: str
    prompt_token_ids: list[int]
    params_json: str


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    """Stop these requests now and free their KV blocks (unknown or finished ids are ignored)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """Abort everything and exit 0."""


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The core loaded its model and serves: what the front needs to check requests."""

    engine_id: int
    pid: int
    model: str  # the model folder
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    description: str  # platform, dtype, for the startup banner
    node_role: str = "both"  # the platform's node role: a worker's default role
    kv_layout: str = ""  # KV layout fingerprint (deepinfer.core.load)
    cost_model: CostModel | None = None  # the step cost model routers predict this core's work with
    kv_store_namespace: str = ""  # hex digest of its KV store namespace ("": no store)
    kv_shared_path: str = ""  # its KV store's shared tier ("": none): where handed-off blocks live
    weight_bytes: int = 0  # its model's weights as held (stored bytes: FP8 values + scales count 1 + 4/block)


class SpecCounts(msgspec.Struct, array_like=True, frozen=True):
    """Speculative-decoding counters since the core started (see ``SpecDecodeStats``)."""

    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    request_steps: int = 0

    @property
    def mean_accepted_len(self) -> float:
        return self.emitted_tokens / self.request_steps if self.request_steps else 0.0


class EngineStats(msgspec.Struct, array_like=True, frozen=True):
    """What one core last saw (sent with every step's outputs)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int = 0  # of which found
    spec: SpecCounts = SpecCounts()
    kv_store: dict | None = None  # KV store counters (deepinfer.kvstore.metrics); None when off
    load: EngineLoad = EngineLoad()  # what routers see (GET /load)
    # a data-parallel rank with expert parallelism: (token, expert) pairs its experts computed per
    # computing step, over the EPLB window (deepinfer.parallel.core); None otherwise
    expert_tokens_per_step: float | None = None

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class CompletionDelta(msgspec.Struct, array_like=True, frozen=True):
    """What one completion (choice ``index``) gained in one step. ``logprobs``: per new token, its
    ``(token id, logprob, rank)`` entries (the sampled token first), when requested."""

    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once it ended
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[list[tuple[int, float, int]]] | None = None


class RequestDelta(msgspec.Struct, array_like=True, frozen=True):
    """One request's progress in one step (only completions that changed are listed)."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    first_scheduled_time: float | None


class Refusal(msgspec.Struct, array_like=True, frozen=True):
    """A request the core did not take. ``field``: the ``SamplingParams`` field at fault when known
    (e.g. ``json_schema`` for a constraint that does not compile); ``invalid``: the input was wrong
    (a 400), else the core failed on it (a 500; the core itself carries on)."""

    request_id: str
    message: str
    field: str | None
    invalid: bool


class StepOutputs(msgspec.Struct, tag=True, frozen=True):
    """Core -> front after each loop turn: requests taken (sent before the step, so a front can
    answer at once), refusals, deltas of the requests that progressed, stats."""

    engine_id: int
    accepted: list[str]
    refusals: list[Refusal]
    deltas: list[RequestDelta]
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True, frozen=True):
    """The core hit an error it cannot continue from (it exits next). ``during_startup``: it never
    became ready (a configuration error: restarting would not help)."""

    engine_id: int
    error: str
    during_startup: bool


ToCore = AddRequest | AbortRequests | Shutdown
FromCore = Ready | StepOutputs | CoreFailed

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def identity(engine_id: int) -> bytes:
    """The ZeroMQ identity a core's DEALER socket uses (the front addresses it by this)."""
    return f"core-{engine_id}".encode()
