"""One client request through the router: estimate, plan, forward, retry, relay.

The body is forwarded unchanged to the worker the policies chose and its answer is relayed back
(status, body, or the event stream byte for byte). The router's request guard has already bounded the
body (size, arrival time, valid Unicode); here it is parsed (a large one off the event loop; nesting
too deep for the parser is a 400), and a body that carries ``kv_transfer`` is refused with a 400
naming it: handoff orders are the router's own (:mod:`deepinfer.router.handoff`), which workers take
only with the cluster key. The client's credentials (``Authorization``, ``x-api-key``, a cluster key
header) are never forwarded: the router's HTTP client proves itself with the cluster key. Each request has a deadline
(``request_timeout_s``); within it, and up to ``max_attempts`` workers, an attempt that fails before
the client has received anything moves to another worker: a refused or broken connection (the worker
is ejected at once), a worker the health checks eject while the attempt waits, no output within
``first_byte_timeout_s`` (streaming), or a retryable status (429, 502, 503, 504). A non-streaming
answer is read whole before it is relayed, so it is retried whenever its worker fails. A stream that
breaks after the client has received output ends with an error event in its API's shape (then
``[DONE]`` for the OpenAI APIs). Every failure is counted by kind in the router's metrics, and each
request once by its outcome: a stream when it ends (``ok`` after its API's last event, ``error`` when
it broke or its worker sent an error event, ``cancelled`` when the client left first).

Paths (:func:`~deepinfer.router.policies.plan`): a short prompt goes straight to a decode-capable
worker; a long one, when a prefill worker and a decode-capable worker report the same shared KV store
(``handoff_ready``), takes two hops (:mod:`deepinfer.router.handoff`'s protocol, one
:class:`~deepinfer.router.handoff.Handoff` per request): the prefill worker computes the prompt (one
token, not streamed) and leases its KV blocks in the store, then the decode worker loads them and
answers the client. A prefill that fails is tried on another prefill worker of that store; a decode
that fails before any output on another decode worker (the same blocks); when the handoff runs out
of workers the request goes on to the next attempt, which plans without the workers tried (so a
decode-capable worker computes the prompt itself). A handoff that ends without the decode's ack has
its lease released at the prefill side (``POST /kv/release``, idempotent), in the background. A
request the handoff cannot carry (several prompts or choices) is served by one worker.

Late binding (estimated-compute, :mod:`deepinfer.router.prefill_queue`): a long prompt's first
attempt is planned only once the prefill worker the policy picks has an expected backlog under
``prefill_horizon_s``; the placement is booked in the load book in the same step, so two waiting
requests never take one free slot. Retries are planned at once. A two-hop answer names the worker that
computed the prompt in ``x-deepinfer-prefill-worker``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import httpx
import msgspec
from fastapi.responses import Response
from starlette.datastructures import Headers

from deepinfer.logger import get_logger
from deepinfer.router.config import RouterConfig
from deepinfer.router.estimate import estimate_request
from deepinfer.router.handoff import Handoff, HandoffError
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.policies import (
    Direct,
    NoWorker,
    Policy,
    RequestInfo,
    TwoHop,
    WorkerView,
    handoff_pairs,
    plan,
)
from deepinfer.router.prefill_queue import PrefillQueue, QueueFull
from deepinfer.router.registry import Registry
from deepinfer.router.stream import Api, EventSplitter, carries_output, dialect, error_events, stream_outcome
from deepinfer.tokenizer import Tokenizer
from deepinfer.web.auth import CLUSTER_KEY_HEADER
from deepinfer.web.errors import ApiError
from deepinfer.web.handoff import PrefillResult
from deepinfer.web.sse import EventStreamResponse

logger = get_logger(__name__)
T = TypeVar("T")
RETRYABLE_STATUS = {429, 502, 503, 504}
HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}
CREDENTIALS = {
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "cookie",
    CLUSTER_KEY_HEADER,
}  # not forwarded
PARSE_INLINE_BYTES = 64 << 10  # larger bodies are parsed in a thread, off the event loop
WORKER_HEADER = "x-deepinfer-worker"  # the worker that answered (the last one tried)
PREFILL_WORKER_HEADER = "x-deepinfer-prefill-worker"  # two hops: the worker that computed the prompt
RELEASE_PATH = "/kv/release"  # deepinfer.server.kv_transfer
CLIENT_ERRORS = {400, 401, 403, 404, 413, 422}  # the request itself is wrong: relayed, not retried
TOKEN_LIMIT = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens",
               "messages": "max_tokens"}  # fmt: skip


class _Ejected(Exception):
    pass


@dataclass(slots=True)
class _Outcome:
    """How one client request ended, counted once in ``deepinfer_router_requests`` (by the proxy
    for a whole answer; by the relay for a stream, when it ends; ``path``: the route taken)."""

    metrics: RouterMetrics
    api: Api
    path: str = "none"
    counted: bool = False

    def count(self, outcome: str) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.requests.labels(api=self.api, path=self.path, outcome=outcome).inc()

    def answered(self, response: Response) -> Response:
        """``response`` is the answer: a whole one is counted ``ok`` now, a stream when it ends."""
        if not isinstance(response, EventStreamResponse):
            self.count("ok")
        return response


@dataclass(slots=True)
class _Failure:
    kind: str  # a RouterMetrics failure kind
    message: str
    response: Response | None = None  # a worker's own error answer, relayed if nothing else works


async def _race(awaitable: Awaitable[T], ejected: asyncio.Event, timeout: float) -> T:
    """``awaitable``'s result; ``TimeoutError`` after ``timeout``; ``_Ejected`` if ``ejected`` is set first."""
    task = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(ejected.wait())
    try:
        done, _ = await asyncio.wait(
            {task, waiter}, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        if waiter in done:
            raise _Ejected
        raise TimeoutError
    finally:
        for f in (task, waiter):
            if not f.done():
                f.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)


class Proxy:
    """Routes requests over the registry's workers (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        client: httpx.AsyncClient,
        tokenizer: Tokenizer,
        prefill: Policy,
        decode: Policy,
        metrics: RouterMetrics,
        queue: PrefillQueue | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.client = client
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.queue = queue  # late binding of long prompts; None: placed at arrival
        self.clock = clock
        self._closing: set[asyncio.Task] = set()

    @property
    def handoff_ready(self) -> bool:
        """True while an admitted prefill worker and an admitted decode-capable worker report the
        same shared KV store (their ``/load``): long prompts then take two hops."""
        return bool(handoff_pairs(self.registry.book.views()))

    async def handle(self, api: Api, path: str, raw: bytes, headers: Headers) -> Response:
        """Route one client request (``raw``: its body, already size-checked by the request guard)
        and return the answer to relay."""
        try:
            body = await _parse(raw)
        except ApiError as error:
            return error.response(dialect(api))
        info = await asyncio.to_thread(estimate_request, path, body, self.tokenizer)
        stream = body.get("stream") is True
        forward = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP | CREDENTIALS}
        outcome = _Outcome(self.metrics, api)
        deadline = self.clock() + self.config.request_timeout_s
        failures: list[tuple[str, _Failure]] = []
        tried: set[str] = set()
        for attempt in range(self.config.max_attempts):
            if attempt and self.clock() >= deadline:
                break
            views = [
                v if v.url not in tried else replace(v, admitted=False) for v in self.registry.book.views()
            ]
            booked: str | None = None  # the load book's id of a placement the queue made
            try:
                if attempt == 0 and self._late(info):
                    route, booked = await self._placed(api, body, info, deadline)
                else:
                    route = plan(
                        info,
                        views,
                        self.prefill,
                        self.decode,
                        self.config.min_disaggregated_tokens,
                        _can_hand_off(api, body),
                    )
            except NoWorker as exc:
                if not failures:
                    self.metrics.failures.labels(kind="no_worker").inc()
                    outcome.count("error")
                    return ApiError(503, f"no worker can serve the request: {exc}").response(dialect(api))
                break
            except QueueFull as exc:
                self.metrics.failures.labels(kind="queue_full").inc()
                outcome.count("error")
                error = ApiError(
                    429, f"the router is at capacity ({exc}); retry later", headers={"Retry-After": "1"}
                )
                return error.response(dialect(api))
            except TimeoutError:
                break  # the deadline passed in the queue
            if attempt:
                self.metrics.retries.inc()
            if isinstance(route, TwoHop):
                outcome.path = "two_hop"
                result = await self._two_hop(api, path, body, forward, stream, info, route, deadline, tried,
                                             failures, outcome, booked)  # fmt: skip
                if result is not None:
                    return outcome.answered(result)
                continue
            url, outcome.path = route.worker.url, route.reason
            tried.add(url)
            result = await self._attempt(
                api, url, path, raw, forward, stream, info, route.worker.request_cost_s(info), deadline,
                outcome, booked=booked,
            )  # fmt: skip
            if isinstance(result, Response):
                return outcome.answered(result)
            self.metrics.failures.labels(kind=result.kind).inc()
            logger.warning("attempt %d on %s failed (%s): %s", attempt + 1, url, result.kind, result.message)
            failures.append((url, result))
        outcome.count("error")
        return self._give_up(api, failures, deadline)

    def _late(self, info: RequestInfo) -> bool:
        """Whether ``info``'s first attempt goes through the prefill queue (a long prompt)."""
        return self.queue is not None and info.prompt_tokens >= self.config.min_disaggregated_tokens

    async def _placed(
        self, api: Api, body: dict, info: RequestInfo, deadline: float
    ) -> tuple[Direct | TwoHop, str]:
        """Plan a long prompt through the prefill queue: the route, once its prefill-side worker is
        under the horizon, and the load book's id of the prompt booked on that worker."""
        book, handoff = self.registry.book, _can_hand_off(api, body)

        def attempt() -> tuple[Direct | TwoHop, str] | None:
            views = book.views()
            route = plan(
                info, views, self.prefill, self.decode, self.config.min_disaggregated_tokens, handoff
            )
            worker = route.prefill if isinstance(route, TwoHop) else route.worker
            if not self.queue.under_horizon(worker.expected_backlog_s):
                return None
            rid = uuid.uuid4().hex
            book.dispatched(worker.url, rid, worker.request_cost_s(info), info.prompt_tokens, self.clock())
            return route, rid

        able = [v for v in book.views() if v.admitted and v.can_prefill]
        cost = min((v.slowdown * v.request_cost_s(info) for v in able), default=0.0)
        return await self.queue.place(attempt, cost, deadline - self.clock())

    def _progress(self) -> None:
        """A worker's load went down: waiting prompts may be placeable."""
        if self.queue is not None:
            self.queue.kick()

    async def _two_hop(
        self,
        api: Api,
        path: str,
        body: dict,
        headers: Mapping[str, str],
        stream: bool,
        info: RequestInfo,
        route: TwoHop,
        deadline: float,
        tried: set[str],
        failures: list[tuple[str, _Failure]],
        outcome: _Outcome,
        booked: str | None = None,
    ) -> Response | None:
        """One request's handoff (see the module docstring): the answer to relay, or None when it
        failed before anything reached the client (the caller tries another path). ``booked``: the
        load book's id of the prompt already booked on ``route.prefill`` (late binding)."""
        store = route.prefill.kv_store_id
        h = Handoff(
            uuid.uuid4().hex,
            time.time() + (deadline - self.clock()),
            self.config.kv_lease_s,
            self.registry.identity.kv_layout if self.registry.identity else "",
        )
        worker: WorkerView | None = route.prefill
        try:
            while True:  # prefill
                order = h.start_prefill(worker.url, time.time())
                tried.add(worker.url)
                got = await self._prefill(
                    api, path, body, headers, worker, info, order, deadline, outcome, booked
                )
                booked = None
                if isinstance(got, PrefillResult):
                    try:
                        h.prefilled(got, time.time())
                        prefilled_on = worker.url
                        break
                    except HandoffError as exc:
                        got = _Failure("handoff", str(exc))
                if got.kind == "client_error":  # the request itself is wrong: the client's answer
                    h.prefill_failed(got.message, time.time())
                    return got.response
                self._failed(failures, worker.url, got)
                if not h.prefill_failed(got.message, time.time()):
                    return None
                worker = self._next(lambda w: w.can_prefill, store, tried, info, self.prefill)
                if worker is None:
                    return None
                self.metrics.retries.inc()
            worker = route.decode
            while True:  # decode
                order = h.start_decode(worker.url, time.time())
                tried.add(worker.url)
                raw = json.dumps({**body, "kv_transfer": msgspec.to_builtins(order)}).encode()
                result = await self._attempt(
                    api, worker.url, path, raw, headers, stream, info, 0.0, deadline, outcome
                )
                if isinstance(result, Response):
                    result.headers[PREFILL_WORKER_HEADER] = prefilled_on
                    h.decode_output()
                    if result.status_code < 400:
                        h.finished()  # the decode worker acked the lease when it loaded the blocks
                    else:
                        h.decode_failed(f"HTTP {result.status_code}", time.time())
                    return result
                self._failed(failures, worker.url, result)
                if not h.decode_failed(result.message, time.time()):
                    return None
                worker = self._next(lambda w: w.can_decode, store, tried, info, self.decode)
                if worker is None:
                    return None
                self.metrics.retries.inc()
        finally:
            if booked is not None:  # never sent: take the booked prompt off its worker
                self.registry.book.finished(route.prefill.url, booked, self.clock())
                self._progress()
            h.abandon("no worker left for the handoff")  # if it has not ended: nothing reached the client
            self.metrics.handoffs.labels(outcome=h.state.value).inc()
            handoff_id = h.take_release()
            if handoff_id is not None:
                for url in h.prefill_workers:
                    self._background(self._release(url, handoff_id))

    def _next(
        self, capable, store: str, tried: set[str], info: RequestInfo, policy: Policy
    ) -> WorkerView | None:
        """Another admitted worker of ``store`` that is ``capable`` and not tried yet, by ``policy``."""
        views = self.registry.book.views()
        candidates = [v for v in views if v.admitted and v.kv_store_id == store and capable(v)]
        candidates = [v for v in candidates if v.url not in tried]
        return policy.choose(info, candidates) if candidates else None

    def _failed(self, failures: list[tuple[str, _Failure]], url: str, failure: _Failure) -> None:
        self.metrics.failures.labels(kind=failure.kind).inc()
        logger.warning("handoff step on %s failed (%s): %s", url, failure.kind, failure.message)
        failures.append((url, failure))

    async def _prefill(
        self,
        api: Api,
        path: str,
        body: dict,
        headers: Mapping[str, str],
        worker: WorkerView,
        info: RequestInfo,
        order,
        deadline: float,
        outcome: _Outcome,
        booked: str | None = None,
    ) -> PrefillResult | _Failure:
        """Send the prefill half to ``worker``: its ``PrefillResult``, or why not (``booked``: see
        :meth:`_two_hop`)."""
        prefill = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        prefill.update({"stream": False, TOKEN_LIMIT[api]: 1, "kv_transfer": msgspec.to_builtins(order)})
        raw = json.dumps(prefill).encode()
        result = await self._attempt(
            api, worker.url, path, raw, headers, False, info, worker.request_cost_s(info), deadline, outcome,
            booked=booked,
        )  # fmt: skip
        if isinstance(result, _Failure):
            return result
        if result.status_code in CLIENT_ERRORS:
            return _Failure("client_error", f"HTTP {result.status_code}", result)
        if result.status_code != 200:
            return _Failure("worker_status", f"HTTP {result.status_code}: {bytes(result.body)[:300]!r}")
        try:
            return msgspec.convert(json.loads(result.body)["kv_transfer"], PrefillResult)
        except (ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            return _Failure("handoff", f"the prefill answer has no valid kv_transfer ({exc})")

    async def _release(self, url: str, handoff_id: str) -> None:
        """Release a lease at the prefill worker (best effort: an unreleased lease expires)."""
        try:
            await self.client.post(f"{url}{RELEASE_PATH}", json={"handoff_id": handoff_id}, timeout=5)
        except httpx.HTTPError as exc:
            logger.info("releasing handoff %s at %s failed (%s); its lease expires", handoff_id, url, exc)

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _give_up(self, api: Api, failures: list[tuple[str, _Failure]], deadline: float) -> Response:
        relayed = [f.response for _, f in failures if f.response is not None]
        if relayed:
            return relayed[-1]
        tried = "; ".join(f"{url}: {f.message}" for url, f in failures) or "no worker tried"
        if self.clock() >= deadline:
            self.metrics.failures.labels(kind="deadline").inc()
            return ApiError(504, f"the request's deadline passed ({tried})").response(dialect(api))
        return ApiError(503, f"no worker could serve the request ({tried})").response(dialect(api))

    async def _attempt(
        self,
        api: Api,
        url: str,
        path: str,
        raw: bytes,
        headers: Mapping[str, str],
        stream: bool,
        info: RequestInfo,
        cost_s: float,
        deadline: float,
        outcome: _Outcome,
        *,
        booked: str | None = None,
    ) -> Response | _Failure:
        """One request to one worker. ``outcome``: the request's, counted by a relayed stream when
        it ends. ``booked``: the load book's id of this attempt, already booked (late binding); else
        it is booked here."""
        book = self.registry.book
        if booked is None:
            rid = uuid.uuid4().hex
            book.dispatched(url, rid, cost_s, info.prompt_tokens, self.clock())
        else:
            rid = booked
        ejected = self.registry.ejected(url)
        self.metrics.dispatched.labels(worker=url).inc()
        request = self.client.build_request("POST", f"{url}{path}", content=raw, headers=headers)
        response: httpx.Response | None = None
        handed_over = False
        try:
            head_timeout = deadline - self.clock()
            if stream:
                head_timeout = min(head_timeout, self.config.first_byte_timeout_s)
            response = await _race(self.client.send(request, stream=True), ejected, head_timeout)
            if response.status_code in RETRYABLE_STATUS:
                body = await _race(response.aread(), ejected, deadline - self.clock())
                return _Failure(
                    "worker_status", f"HTTP {response.status_code}", self._relay(response, body, url)
                )
            if not stream or not response.headers.get("content-type", "").startswith("text/event-stream"):
                body = await _race(response.aread(), ejected, deadline - self.clock())
                return self._relay(response, body, url)
            opening, chunks = await self._opening(api, response, ejected, deadline)
            book.prefilled(url, rid, self.clock())
            self._progress()
            handed_over = True
            events = self._relay_stream(api, url, rid, response, chunks, opening, ejected, deadline, outcome)
            relayed = EventStreamResponse(events, on_close=lambda: self._closed(url, rid, response, outcome))
            relayed.headers[WORKER_HEADER] = url
            return relayed
        except _Ejected:
            return _Failure("ejected", "the worker was ejected while the attempt waited")
        except TimeoutError:
            return _Failure("timeout", "no answer in time")
        except httpx.HTTPError as exc:
            if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                self.registry.eject(url, f"{type(exc).__name__}: {exc}")
            return _Failure("connect", f"{type(exc).__name__}: {exc}")
        finally:
            if not handed_over:
                book.finished(url, rid, self.clock())
                self._progress()
                if response is not None:
                    await response.aclose()

    def _closed(self, url: str, rid: str, response: httpx.Response, outcome: _Outcome) -> None:
        """A relayed stream ended, however it ended (also when it never started): idempotent. One
        not counted yet ended before its last event: the client left."""
        outcome.count("cancelled")
        self.registry.book.finished(url, rid, self.clock())
        self._progress()
        if not response.is_closed:
            self._background(response.aclose())

    @staticmethod
    def _ends(api: Api, event: bytes, outcome: _Outcome) -> None:
        """Count the request when ``event`` ends its stream or reports an error (before the client
        sees it, so a client that has read the stream finds it counted)."""
        ended = stream_outcome(api, event)
        if ended is not None:
            outcome.count(ended)

    @staticmethod
    def _relay(response: httpx.Response, body: bytes, url: str) -> Response:
        keep = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after")}
        return Response(body, status_code=response.status_code, headers={**keep, WORKER_HEADER: url})

    async def _opening(
        self, api: Api, response: httpx.Response, ejected: asyncio.Event, deadline: float
    ) -> tuple[list[bytes], AsyncGenerator[bytes, None]]:
        """Read a stream up to its first output event; returns the events so far and the rest."""
        chunks = response.aiter_raw()
        splitter, held = EventSplitter(), []
        limit = min(deadline, self.clock() + self.config.first_byte_timeout_s)
        while True:
            try:
                chunk = await _race(anext(chunks), ejected, limit - self.clock())
            except StopAsyncIteration:
                raise httpx.RemoteProtocolError("the worker ended the stream before any output") from None
            for event in splitter.feed(chunk):
                held.append(event)
                if carries_output(api, event):
                    return held, self._rest(chunks, splitter)

    @staticmethod
    async def _rest(
        chunks: AsyncGenerator[bytes, None], splitter: EventSplitter
    ) -> AsyncGenerator[bytes, None]:
        async for chunk in chunks:
            for event in splitter.feed(chunk):
                yield event

    async def _relay_stream(
        self,
        api: Api,
        url: str,
        rid: str,
        response: httpx.Response,
        rest: AsyncGenerator[bytes, None],
        opening: list[bytes],
        ejected: asyncio.Event,
        deadline: float,
        outcome: _Outcome,
    ) -> AsyncGenerator[str, None]:
        """The worker's events, counted into ``outcome`` as the last (or an error) one passes."""
        sent = 0
        try:
            for event in opening:
                self._ends(api, event, outcome)
                yield event.decode()
                sent += 1
            while True:
                try:
                    event = await _race(anext(rest), ejected, deadline - self.clock())
                except StopAsyncIteration:
                    if not outcome.counted:  # no last event: the worker cut the stream short
                        self.metrics.failures.labels(kind="mid_stream").inc()
                        outcome.count("error")
                    return
                self._ends(api, event, outcome)
                yield event.decode()
                sent += 1
        except (httpx.HTTPError, _Ejected, TimeoutError) as exc:
            outcome.count("error")
            kind = {"_Ejected": "ejected", "TimeoutError": "timeout"}.get(type(exc).__name__, "mid_stream")
            reason = {"ejected": "the worker stopped answering", "timeout": "the request's deadline passed"}
            self.metrics.failures.labels(kind="mid_stream").inc()
            if kind == "mid_stream":
                self.registry.eject(url, f"stream broke: {type(exc).__name__}: {exc}")
            message = (
                f"the worker serving this request failed mid-stream ({reason.get(kind, type(exc).__name__)})"
            )
            yield error_events(api, ApiError(502, message), sent).decode()
        finally:
            self.registry.book.finished(url, rid, self.clock())
            self._progress()
            await rest.aclose()
            await response.aclose()


async def _parse(raw: bytes) -> dict:
    """The JSON object in a request body (a large body is parsed in a thread); ``ApiError`` 400 when
    it is not valid JSON, not an object, nests too deeply, or carries ``kv_transfer``."""
    try:
        body = json.loads(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it nests too deeply") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body is not valid JSON: the request body must be a JSON object")
    if "kv_transfer" in body:
        raise ApiError(
            400,
            "kv_transfer: handoff orders come only from the router itself; a client may not send one",
            param="kv_transfer",
        )
    return body


def _can_hand_off(api: Api, body: dict) -> bool:
    """Whether the handoff can carry the request: one prompt, one choice."""
    if body.get("n") not in (None, 1):
        return False
    prompt = body.get("prompt")
    return not (
        api == "completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    )
