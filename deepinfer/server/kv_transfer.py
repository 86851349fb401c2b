"""The worker's side of the prefill->decode KV handoff (the router's side and the messages:
:mod:`deepinfer.router.handoff`).

A request body may carry ``kv_transfer``; :class:`KVTransferMiddleware` takes it out before the API
route parses the body, and the route runs as usual, its engine request watched through
:func:`observe` (called by ``ServingContext.admit``). Orders come only from a router: a request that
carries one without the cluster key (``deepinfer.web.auth``: the ``x-deepinfer-cluster-key`` header
holding this worker's ``cluster_secret``) is refused with 403 naming ``kv_transfer`` (a worker
without a cluster secret takes no orders), and an order's times must be finite, its ``lease_s`` over
0 and at most :data:`~deepinfer.web.handoff.MAX_LEASE_S` seconds (else 400 naming the field):

- :class:`~deepinfer.router.handoff.PrefillOrder` (prefill- and both-role workers): the request runs
  as sent (the router asks for one token, not streamed). Its engine core saves the prompt's full
  blocks to the KV store, which writes them behind to the shared tier; this worker waits until the
  blocks the decode side can use (every full block before the last prompt token) are whole files
  there, fsyncs their folders, takes a lease on their keys in the store's lease table
  (:class:`~deepinfer.kvstore.leases.LeaseTable`) and adds ``kv_transfer`` =
  :class:`~deepinfer.router.handoff.PrefillResult` to its JSON answer. A block whose file does not
  appear in time (a refused save) ends the list there: the decode side computes the rest.
- :class:`~deepinfer.router.handoff.DecodeOrder` (decode- and both-role workers): the request runs as
  sent; blocks are content-addressed, so the engine core's store connector finds the prefill's
  blocks by the prompt's own block hashes and loads them (a missing or corrupt block is a miss: it
  and the ones after it are recomputed, never read wrong). At the first output the load is over:
  this worker counts blocks loaded and recomputed and releases the lease in the store (the decode's
  ack; idempotent). The usage it answers with counts as cached only the prompt tokens the prefill
  worker found cached (``DecodeOrder.num_cached_tokens``): the blocks the handoff delivered were
  computed for this request, so they are not cache hits the client is billed as such.

Leases end three ways: the decode's ack, ``POST /kv/release`` (the router, when a handoff ended
without that ack) and expiry (an unreleased lease holds nothing past ``lease_expires_unix``; the
prefill worker removes its expired leases whenever it is asked for its load, its metrics or a new
prefill, and counts them). ``GET /load`` reports the store's id and this worker's live leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.core.roles import Role
from deepinfer.engine.kv_cache_manager import hash_block
from deepinfer.kvstore.file_tier import block_path, namespace_dir
from deepinfer.kvstore.keys import store_key
from deepinfer.kvstore.leases import LeaseTable, check_handoff_id, fsync_dir
from deepinfer.logger import get_logger
from deepinfer.web.auth import CLUSTER_KEY_HEADER, has_cluster_key
from deepinfer.web.errors import ApiError, dialect_of
from deepinfer.web.handoff import MAX_LEASE_S, DecodeOrder, PrefillOrder, PrefillResult

if TYPE_CHECKING:
    from fastapi import FastAPI

    from deepinfer.core.client import RequestStream
    from deepinfer.outputs import RequestOutput
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.server.context import ServingContext

logger = get_logger(__name__)
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
RELEASE_PATH = "/kv/release"
SAVE_WAIT_S = 10.0  # longest wait for the prompt's blocks to reach the shared tier
POLL_S = 0.002
router = APIRouter()


@dataclass(slots=True)
class _Watch:
    """One admitted engine request of a request that carries ``kv_transfer``."""

    prompt_token_ids: list[int]
    params: SamplingParams
    first: RequestOutput | None = None
    final: RequestOutput | None = None


@dataclass(slots=True)
class _Transfer:
    order: PrefillOrder | DecodeOrder
    kvt: KVTransfer
    watches: list[_Watch] = field(default_factory=list)


_current: ContextVar[_Transfer | None] = ContextVar("deepinfer_kv_transfer", default=None)


class _Tap:
    """A ``RequestStream`` that also records its first and last output (and calls ``on_first``);
    with ``cached_tokens`` set (a decode), the outputs it hands on report that many cached prompt
    tokens (at most the prompt's length) instead of the engine's count (see the module docstring)."""

    def __init__(
        self, stream: RequestStream, watch: _Watch, on_first, cached_tokens: int | None = None
    ) -> None:
        self._stream, self._watch, self._on_first = stream, watch, on_first
        self._cached_tokens = cached_tokens
        self.request_id = stream.request_id

    async def accepted(self) -> None:
        await self._stream.accepted()

    def __aiter__(self) -> _Tap:
        return self

    async def __anext__(self) -> RequestOutput:
        output = await self._stream.__anext__()
        if self._watch.first is None:
            self._watch.first = output
            self._on_first(self._watch)
        self._watch.final = output
        if self._cached_tokens is None:
            return output
        return replace(output, num_cached_tokens=min(self._cached_tokens, len(output.prompt_token_ids)))

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> _Tap:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def observe(prompt_token_ids: list[int], params: SamplingParams, stream: RequestStream) -> RequestStream:
    """``stream``, watched when the HTTP request being served carries ``kv_transfer`` (called by
    ``ServingContext.admit`` for every engine request it submits)."""
    transfer = _current.get()
    if transfer is None:
        return stream
    watch = _Watch(list(prompt_token_ids), params)
    transfer.watches.append(watch)
    if isinstance(transfer.order, DecodeOrder):
        order = transfer.order
        return _Tap(stream, watch, lambda w: transfer.kvt.decoded(order, w), order.num_cached_tokens)  # type: ignore[return-value]
    return _Tap(stream, watch, lambda w: None)  # type: ignore[return-value]  # the same interface


class KVTransfer:
    """A worker's handoff state and counters (one per server; on ``app.state.kv_transfer``)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._table: LeaseTable | None = None
        self.counts = dict.fromkeys(
            ("prefills", "decodes", "loaded_blocks", "recomputed_blocks", "acked", "released", "expired",
             "first_token_mismatches", "save_timeouts"), 0,
        )  # fmt: skip

    # ------------------------------------------------------------------ the store
    def table(self) -> LeaseTable | None:
        """The shared store's lease table (None: the engine core has no shared tier, or is not ready)."""
        if self._table is None:
            info = self.ctx.client.info
            if info is not None and info.kv_shared_path:
                self._table = LeaseTable(info.kv_shared_path)
        return self._table

    def store_id(self) -> str:
        table = self.table()
        return table.store_id() if table is not None else ""

    def live_leases(self) -> int:
        """This worker's leases once the expired ones are swept."""
        table = self.table()
        if table is None:
            return 0
        self.sweep()
        return len(table.leases(self.owner))

    def sweep(self) -> None:
        table = self.table()
        if table is not None:
            for handoff_id in table.expire(owner=self.owner):
                self.counts["expired"] += 1
                logger.info("kv handoff %s: the lease expired before a decode worker loaded it", handoff_id)

    def block_keys(self, prompt_token_ids: list[int]) -> list[str]:
        """Hex store keys of the prompt's blocks a decode worker can load: the full blocks before
        its last token (the engine's hash chain under the core's store namespace)."""
        info = self.ctx.client.info
        namespace, bs = bytes.fromhex(info.kv_store_namespace), info.block_size
        keys, parent = [], None
        for i in range((len(prompt_token_ids) - 1) // bs):
            parent = hash_block(parent, prompt_token_ids[i * bs : (i + 1) * bs])
            keys.append(store_key(namespace, parent).hex())
        return keys

    async def _written(self, keys: list[str], until: float) -> list[str]:
        """The leading ``keys`` whose block files are in the shared tier (waiting up to ``until``,
        unix seconds), their folders fsynced."""
        info = self.ctx.client.info
        folder = namespace_dir(info.kv_shared_path, bytes.fromhex(info.kv_store_namespace))
        paths = [block_path(folder, bytes.fromhex(k)) for k in keys]
        done = 0
        while done < len(paths):
            if paths[done].is_file():
                done += 1
                continue
            if time.time() >= until:
                self.counts["save_timeouts"] += 1
                break
            await asyncio.sleep(POLL_S)
        await asyncio.to_thread(lambda: [fsync_dir(d) for d in {p.parent for p in paths[:done]}])
        return keys[:done]

    # ------------------------------------------------------------------ the two sides
    def check(self, order: PrefillOrder | DecodeOrder) -> None:
        """``ApiError`` when this worker cannot take ``order`` (its role, no shared store, the deadline)."""
        from deepinfer.server.router_api import worker_role

        prefill = isinstance(order, PrefillOrder)
        role = worker_role(self.ctx)
        allowed = (Role.PREFILL, Role.BOTH) if prefill else (Role.DECODE, Role.BOTH)
        if role not in allowed:
            side = "prefill" if prefill else "decode"
            raise ApiError(
                409, f"kv_transfer: this worker's role is {role and role.value}; it does not {side}"
            )
        if self.table() is None:
            raise ApiError(
                409, "kv_transfer: this worker has no shared KV store (start it with --kv-shared-path)"
            )
        if time.time() >= order.deadline_unix:
            raise ApiError(504, "kv_transfer: the request's deadline passed")

    async def prefilled(self, transfer: _Transfer, answer: dict[str, Any]) -> dict[str, Any]:
        """The prefill's answer with ``kv_transfer`` = ``PrefillResult`` added, once its blocks are
        durable in the shared tier and leased."""
        order: PrefillOrder = transfer.order
        if len(transfer.watches) != 1 or transfer.watches[0].params.n != 1:
            raise ApiError(400, "kv_transfer: a handoff carries one prompt and one choice")
        watch = transfer.watches[0]
        final = watch.final
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            raise ApiError(500, "kv_transfer: the prefill produced no token")
        keys = await self._written(
            self.block_keys(watch.prompt_token_ids), min(order.deadline_unix, time.time() + SAVE_WAIT_S)
        )
        expires = time.time() + order.lease_s
        table = self.table()
        await asyncio.to_thread(table.take, order.handoff_id, keys, expires, self.owner)
        self.counts["prefills"] += 1
        self.sweep()
        result = PrefillResult(
            handoff_id=order.handoff_id,
            first_token_id=final.outputs[0].token_ids[0],
            block_keys=keys,
            num_prompt_tokens=len(watch.prompt_token_ids),
            num_cached_tokens=final.num_cached_tokens,
            kv_layout=self.ctx.client.info.kv_layout,
            lease_expires_unix=expires,
        )
        return {**answer, "kv_transfer": msgspec.to_builtins(result)}

    def decoded(self, order: DecodeOrder, watch: _Watch) -> None:
        """The decode's first output: the store load is over; count it and ack the lease."""
        self.counts["decodes"] += 1
        bs = self.ctx.client.info.block_size
        own = self.block_keys(watch.prompt_token_ids)
        usable = 0
        while usable < min(len(own), len(order.block_keys)) and own[usable] == order.block_keys[usable]:
            usable += 1
        first = watch.first
        loaded = min(first.num_cached_tokens // bs, usable)
        self.counts["loaded_blocks"] += loaded
        self.counts["recomputed_blocks"] += len(order.block_keys) - loaded
        tokens = first.outputs[0].token_ids if first.outputs else []
        if watch.params.temperature == 0 and tokens and tokens[0] != order.first_token_id:
            self.counts["first_token_mismatches"] += 1
            logger.warning(
                "kv handoff %s: greedy first token %d differs from the prefill's %d",
                order.handoff_id, tokens[0], order.first_token_id,
            )  # fmt: skip
        table = self.table()
        if table is not None and table.release(order.handoff_id):
            self.counts["acked"] += 1

    def release(self, handoff_id: str) -> bool:
        table = self.table()
        released = table is not None and table.release(handoff_id)
        self.counts["released"] += released
        return released


class _Collector(Collector):
    def __init__(self, kvt: KVTransfer) -> None:
        self._kvt = kvt

    def collect(self) -> Iterator[Metric]:
        kvt = self._kvt
        yield GaugeMetricFamily(
            "deepinfer_kv_handoff_leases", "KV handoff leases this worker holds", value=kvt.live_leases()
        )
        helps = {
            "prefills": "prefills handed off (blocks leased)",
            "decodes": "decodes of handed-off prompts",
            "loaded_blocks": "handed-off blocks the decode loaded from the store",
            "recomputed_blocks": "handed-off blocks the decode recomputed (missing or corrupt in the store)",
            "acked": "leases released by this decode worker's ack",
            "released": "leases released on request (POST /kv/release)",
            "expired": "leases that expired before a decode worker loaded them",
            "first_token_mismatches": "greedy decodes whose first token differs from the prefill's",
            "save_timeouts": "prefills whose blocks did not all reach the shared tier in time",
        }
        for name, help_text in helps.items():
            yield CounterMetricFamily(f"deepinfer_kv_handoff_{name}", help_text, value=kvt.counts[name])


class _ReleaseBody(msgspec.Struct, frozen=True):
    handoff_id: str


@router.post(RELEASE_PATH, include_in_schema=False)  # between workers and routers, not for clients
async def release(request: Request) -> JSONResponse:
    """Release a handoff's lease (``{"handoff_id": ...}``); idempotent: ``released`` says whether it
    was still held."""
    try:
        body = msgspec.json.decode(await request.body(), type=_ReleaseBody)
        check_handoff_id(body.handoff_id)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        return JSONResponse({"error": f"handoff_id: {exc}"}, status_code=400)
    kvt: KVTransfer = request.app.state.kv_transfer
    return JSONResponse({"released": await asyncio.to_thread(kvt.release, body.handoff_id)})


class KVTransferMiddleware:
    """Takes ``kv_transfer`` out of API request bodies and runs the request as its order says
    (pure ASGI, inside the request guard, so the body is already size-checked)."""

    def __init__(self, app, kvt: KVTransfer) -> None:
        self.app, self.kvt = app, kvt

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in API_PATHS:
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        order, body = None, None
        if b'"kv_transfer"' in raw:
            with contextlib.suppress(ValueError, RecursionError):  # not JSON: the route answers 400
                body = json.loads(raw)
        if isinstance(body, dict) and "kv_transfer" in body:
            try:
                _authorise(scope, self.kvt.ctx.config.cluster_secret)
                order = _order(body.pop("kv_transfer"))
                self.kvt.check(order)
            except ApiError as exc:
                await exc.response(dialect_of(scope["path"]))(scope, receive, send)
                return
            raw = json.dumps(body).encode()
        replay = _replay(raw, receive)
        if order is None:
            await self.app(scope, replay, send)
            return
        transfer = _Transfer(order, self.kvt)
        token = _current.set(transfer)
        try:
            if isinstance(order, DecodeOrder):
                await self.app(scope, replay, send)
                return
            captured = _Captured()
            await self.app(scope, replay, captured.send)
        finally:
            _current.reset(token)
        if captured.status != 200:
            await captured.replay(send)
            return
        try:
            answer = await self.kvt.prefilled(transfer, json.loads(captured.body))
        except ApiError as exc:
            await exc.response(dialect_of(scope["path"]))(scope, receive, send)
            return
        await JSONResponse(answer)(scope, receive, send)


def _authorise(scope, secret: str | None) -> None:
    """``ApiError`` 403 unless the request carries the cluster key (only a router sends orders)."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if has_cluster_key(headers, secret):
        return
    why = (
        "this worker has no cluster secret (--cluster-secret-file or DEEPINFER_CLUSTER_SECRET), so it takes none"
        if secret is None
        else f"the request has no valid {CLUSTER_KEY_HEADER} header"
    )
    raise ApiError(
        403, f"kv_transfer: handoff orders are accepted only from a router holding the cluster secret; {why}",
        param="kv_transfer",
    )  # fmt: skip


def _order(value: object) -> PrefillOrder | DecodeOrder:
    """The order in a body's ``kv_transfer``, checked (see the module docstring); else a 400 naming
    the field."""
    kind = DecodeOrder if isinstance(value, dict) and "block_keys" in value else PrefillOrder
    try:
        order = msgspec.convert(value, kind)
        check_handoff_id(order.handoff_id)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ApiError(400, f"kv_transfer: {exc}", param="kv_transfer") from None
    times = ("deadline_unix", "lease_s") if kind is PrefillOrder else ("deadline_unix", "lease_expires_unix")
    for name in times:
        if not math.isfinite(getattr(order, name)):
            _invalid(name, f"{getattr(order, name)!r} is not a finite number")
    if isinstance(order, PrefillOrder) and not 0 < order.lease_s <= MAX_LEASE_S:
        _invalid(
            "lease_s", f"{order.lease_s:g} s is out of range; accepted: over 0 and at most {MAX_LEASE_S:g} s"
        )
    if isinstance(order, DecodeOrder) and not 0 <= order.num_cached_tokens <= order.num_prompt_tokens:
        _invalid(
            "num_cached_tokens",
            f"{order.num_cached_tokens} is out of range; accepted: 0 to num_prompt_tokens ({order.num_prompt_tokens})",
        )
    return order


def _invalid(name: str, why: str) -> None:
    raise ApiError(400, f"kv_transfer.{name}: {why}", param=f"kv_transfer.{name}")


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(raw: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()  # the client's disconnect

    return replay


class _Captured:
    """A whole (non-streaming) ASGI response, held back."""

    def __init__(self) -> None:
        self.start: dict | None = None
        self.chunks: list[bytes] = []

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))

    @property
    def status(self) -> int:
        return self.start["status"] if self.start else 500

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    async def replay(self, send) -> None:
        await send(self.start or {"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": self.body})


def install(app: FastAPI, ctx: ServingContext, registry) -> KVTransfer:
    """Mount the handoff on a server app: the middleware (call before the request guard is added,
    so the guard runs first), ``POST /kv/release`` and the counters in ``registry``."""
    kvt = KVTransfer(ctx)
    ctx.stream_observer = observe
    app.state.kv_transfer = kvt
    app.include_router(router)
    app.add_middleware(KVTransferMiddleware, kvt=kvt)
    registry.register(_Collector(kvt))
    return kvt
