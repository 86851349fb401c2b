"""The router's workers: who they are, whether they are admitted, and their load.

Each worker is polled every ``poll_interval_s`` on ``GET /load`` (one request is both the health
check and the load report). ``eject_after`` consecutive failures (no answer, an error status, or
``healthy: false``) eject it: policies stop choosing it and attempts still waiting on it are told
(:meth:`Registry.ejected`) so they move elsewhere. A failed connection while proxying ejects at once.
The next good poll re-admits it. Workers named on the command line are checked at startup (reachable,
the declared role, one model, one KV layout, the router's tokenizer); one that registers itself
(``POST /router/register``, authenticated by the router's app before this is asked) is checked the
same way and takes the role it reports. A registered worker leaves with ``POST /router/deregister``
(:meth:`Registry.remove`), and one that stays ejected for ``deregister_after_s`` is forgotten too, so
a dead worker does not keep the router degraded; workers named on the command line are only ejected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec

from deepinfer.core.load import LOAD_PATH, WorkerLoad
from deepinfer.core.roles import Role
from deepinfer.logger import get_logger
from deepinfer.router.loadbook import LoadBook
from deepinfer.router.metrics import RouterMetrics

logger = get_logger(__name__)
OPTION_ROLES = {"--prefill": Role.PREFILL, "--decode": Role.DECODE, "--both": Role.BOTH}


class WorkerRejected(ValueError):
    """A worker that cannot join: unreachable, or another role, model or KV layout. The message is
    one line naming the option (or registration) that brought it."""


REGISTRATION = "registration"  # the option of a worker that registered itself


@dataclass(slots=True)
class _Record:
    option: str  # "--prefill", "--decode", "--both" or REGISTRATION
    failures: int = 0
    ejected: asyncio.Event = field(default_factory=asyncio.Event)
    ejected_at: float | None = None  # when it was last ejected (None: admitted)


@dataclass(frozen=True, slots=True)
class Identity:
    """What every worker of one router must share."""

    model: str
    model_fingerprint: str
    kv_layout: str
    source: str  # "--decode http://..." : where the reference came from


class Registry:
    """See the module docstring. Owns the :class:`LoadBook` the policies read."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        poll_interval_s: float,
        poll_timeout_s: float,
        eject_after: int,
        tokenizer_fingerprint: str,
        tokenizer_source: str,
        clock: Callable[[], float] = time.monotonic,
        deregister_after_s: float = 10.0,
    ) -> None:
        self.book = LoadBook()
        self.identity: Identity | None = None
        self._client = client
        self._metrics = metrics
        self._interval = poll_interval_s
        self._timeout = poll_timeout_s
        self._eject_after = eject_after
        self._deregister_after = deregister_after_s
        self._tokenizer = (tokenizer_fingerprint, tokenizer_source)
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self.listeners: list[Callable[[], None]] = []  # called after each load report is taken in

    # ------------------------------------------------------------------ joining
    async def _fetch(self, url: str) -> WorkerLoad:
        response = await self._client.get(f"{url}{LOAD_PATH}", timeout=self._timeout)
        response.raise_for_status()
        return msgspec.json.decode(response.content, type=WorkerLoad)

    def _check(self, url: str, option: str, load: WorkerLoad) -> None:
        where = f"{option} {url}" if option != REGISTRATION else f"registration of {url}"
        expected = OPTION_ROLES.get(option)
        if expected is not None and load.role is not expected:
            raise WorkerRejected(
                f"{where}: the worker there has role {load.role.value} (start it with --role {expected.value}, or list "
                f"it under --{load.role.value})"
            )
        fingerprint, source = self._tokenizer
        if load.model_fingerprint != fingerprint:
            raise WorkerRejected(
                f"{where}: the worker serves another model or tokenizer than the router's {source} (fingerprint "
                f"{load.model_fingerprint}, the router's {fingerprint})"
            )
        ref = self.identity
        if ref is None:
            return
        if load.model != ref.model:
            raise WorkerRejected(
                f"{where}: the worker serves model {load.model!r}, {ref.source} serves {ref.model!r}"
            )
        if load.kv_layout != ref.kv_layout:
            raise WorkerRejected(
                f"{where}: the worker's KV layout {load.kv_layout} differs from {ref.source}'s {ref.kv_layout}"
            )

    async def add(self, url: str, option: str) -> WorkerLoad:
        """Check the worker at ``url`` and admit it; ``WorkerRejected`` says why it cannot join."""
        requested = self._clock()
        where = f"{option} {url}" if option != REGISTRATION else f"registration of {url}"
        try:
            load = await self._fetch(url)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code in (401, 403):
                raise WorkerRejected(
                    f"{where}: the worker refused the router's load poll ({exc.response.status_code}): it needs "
                    "the cluster secret the router and its workers share: give the router and the workers "
                    "--cluster-secret-file PATH or DEEPINFER_CLUSTER_SECRET"
                ) from None
            raise WorkerRejected(f"{where}: no worker answers there ({type(exc).__name__}: {exc})") from None
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            raise WorkerRejected(f"{where}: no worker answers there ({type(exc).__name__}: {exc})") from None
        self._check(url, option, load)
        if self.identity is None:
            self.identity = Identity(load.model, load.model_fingerprint, load.kv_layout, f"{option} {url}")
        if url not in self._records:
            self._records[url] = _Record(option)
            logger.info("worker %s (%s) joined", url, load.role.value)
        self.book.observe(url, load, requested)
        self._readmit(url)
        return load

    async def add_configured(self, workers: dict[str, str], timeout_s: float) -> None:
        """Admit the workers named on the command line, waiting up to ``timeout_s`` for each to answer."""
        deadline = self._clock() + timeout_s
        for url, option in workers.items():
            while True:
                try:
                    await self.add(url, option)
                    break
                except WorkerRejected as exc:
                    if "no worker answers" not in str(exc) or self._clock() > deadline:
                        raise
                await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ admission
    def ejected(self, url: str) -> asyncio.Event:
        """Set while ``url`` is ejected or gone (a new event after each re-admission)."""
        record = self._records.get(url)
        if record is None:
            gone = asyncio.Event()
            gone.set()
            return gone
        return record.ejected

    def eject(self, url: str, reason: str) -> None:
        record = self._records.get(url)
        if record is None or not self.book.admitted(url):
            return
        self.book.set_admitted(url, False)
        record.ejected.set()
        record.ejected_at = self._clock()
        self._metrics.ejections.labels(worker=url).inc()
        logger.warning("worker %s ejected: %s", url, reason)

    def _readmit(self, url: str) -> None:
        record = self._records[url]
        record.failures = 0
        record.ejected_at = None
        if not self.book.admitted(url):
            self.book.set_admitted(url, True)
            record.ejected = asyncio.Event()
            self._metrics.readmissions.labels(worker=url).inc()
            logger.info("worker %s re-admitted", url)

    def registered(self, url: str) -> bool:
        """Whether ``url`` joined by registering itself (not named on the command line)."""
        record = self._records.get(url)
        return record is not None and record.option == REGISTRATION

    def remove(self, url: str, reason: str) -> None:
        """Forget the registered worker ``url``: policies stop choosing it and attempts waiting on it
        move elsewhere. ``ValueError`` for a worker named on the command line (those stay)."""
        record = self._records.get(url)
        if record is None:
            return
        if record.option != REGISTRATION:
            raise ValueError(f"{url} was named on the command line ({record.option}); it is not deregistered")
        del self._records[url]
        record.ejected.set()
        self.book.remove(url)
        logger.warning("worker %s deregistered: %s", url, reason)

    def _forget_long_ejected(self) -> None:
        now = self._clock()
        for url, record in list(self._records.items()):
            ejected_at = record.ejected_at
            if (
                record.option == REGISTRATION
                and ejected_at is not None
                and now - ejected_at >= self._deregister_after
            ):
                self.remove(url, f"ejected for {self._deregister_after:g} s")

    def admitted(self, url: str) -> bool:
        return url in self._records and self.book.admitted(url) and self.book.report(url).healthy

    def status(self) -> dict[str, dict]:
        return {
            url: {
                "role": self.book.report(url).role.value,
                "admitted": self.admitted(url),
                "source": r.option,
            }
            for url, r in self._records.items()
        }

    # ------------------------------------------------------------------ polling
    async def _poll(self, url: str) -> None:
        requested = self._clock()
        try:
            load = await self._fetch(url)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            self._failed(url, f"load poll failed: {type(exc).__name__}: {exc}")
            return
        if url not in self._records:  # deregistered while it was polled
            return
        self.book.observe(url, load, requested)
        if load.healthy:
            self._readmit(url)
        else:
            self._failed(url, "the worker reports itself unhealthy")
        for listener in self.listeners:
            listener()

    def _failed(self, url: str, reason: str) -> None:
        record = self._records.get(url)
        if record is None:  # deregistered while it was polled
            return
        record.failures += 1
        self._metrics.failures.labels(kind="health").inc()
        if record.failures >= self._eject_after:
            self.eject(url, reason)

    async def poll_forever(self) -> None:
        """Poll every worker each interval until cancelled."""
        while True:
            started = self._clock()
            try:
                await asyncio.gather(*(self._poll(url) for url in list(self._records)))
                self._forget_long_ejected()
            except Exception:  # a bug in one poll must not end health checking
                logger.exception("polling the workers failed")
            await asyncio.sleep(max(0.0, self._interval - (self._clock() - started)))
