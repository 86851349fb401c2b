"""The engine channel as the front sees it (``EngineClient``): where it listens (a socket file in a
private folder, removed once the core connected; never an abstract socket any local user can
reach), what it believes (a frame only for the engine id and the requests of its sender; malformed
or forged frames are dropped and counted, the reader carries on), and how it sends (never a silent
drop: a flood past a tiny high-water mark waits and arrives in order; an AddRequest that cannot
leave in time fails with a clear error; an abort is never lost)."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from deepinfer.config import EngineConfig
from deepinfer.core import messages as m
from deepinfer.core.client import CoreStartupError, EngineClient, EngineDead
from deepinfer.core.launch import CoreHandle, CoreThread
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.metrics import ServerMetrics

OPTIONS = {"num_kv_blocks": 64, "max_model_len": 256}


def run_bounded(scenario, timeout_s: float) -> None:
    """``asyncio.run(scenario())`` in a thread, failing the test if it has not ended (cleanup
    included: a core left running would hold ``asyncio.run``'s executor) within ``timeout_s``."""
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(asyncio.wait_for(scenario(), timeout_s))
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=main, name="channel-scenario", daemon=True)
    thread.start()
    thread.join(timeout_s + 30)
    assert not thread.is_alive(), f"the scenario hung past {timeout_s + 30:g} s"
    if errors:
        raise errors[0]


def unix_sockets(pid: int) -> list[str]:
    """The paths (abstract ones start with ``@``) of the Unix sockets process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    paths = []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes:
                paths.append(fields[7])
    return paths


def test_the_channel_is_a_private_socket_file_removed_once_the_core_connected(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), detokenize=False, **OPTIONS))
    seen: dict[str, object] = {}

    def launcher(engine_id: int, address: str) -> CoreHandle:
        assert address.startswith("ipc://")
        path = Path(address.removeprefix("ipc://"))
        seen["path"] = path
        seen["folder_mode"] = stat.S_IMODE(path.parent.stat().st_mode)
        seen["is_socket"] = stat.S_ISSOCK(path.stat().st_mode)
        return CoreThread(engine, engine_id, address)

    async def scenario() -> None:
        client = EngineClient(launcher, None, 8)
        await client.start()
        try:
            seen["sockets"] = unix_sockets(os.getpid())
            stream = client.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
            with stream:
                outputs = [out async for out in stream]
            seen["tokens"] = len(outputs[-1].outputs[0].token_ids)
        finally:
            await client.stop()

    run_bounded(scenario, 60)
    assert seen["is_socket"] and seen["folder_mode"] == 0o700
    assert not seen["path"].exists() and not seen["path"].parent.exists()  # gone once connected
    # the old channel was an abstract socket, ipc://@deepinfer-<pid>-<uuid>, listed in /proc/net/unix
    # for anyone to connect to; this process now holds no abstract socket at all
    assert not [p for p in seen["sockets"] if p.startswith("@")], seen["sockets"]
    assert seen["tokens"] == 3


def test_forged_and_malformed_frames_are_dropped_and_the_reader_carries_on(tiny_model: Path) -> None:
    """A local process that got onto the channel (here: connected while the core was starting)
    cannot finish, fail or fake another core's requests, nor crash the reader."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), detokenize=False, **OPTIONS))
    context = zmq.Context()
    rogues: list[zmq.Socket] = []

    def launcher(engine_id: int, address: str) -> CoreHandle:
        for identity in (b"core-7", None):
            rogue = context.socket(zmq.DEALER)
            rogue.setsockopt(zmq.LINGER, 0)
            if identity is not None:
                rogue.setsockopt(zmq.IDENTITY, identity)
            rogue.connect(address)
            rogues.append(rogue)
        return CoreThread(engine, engine_id, address)

    def finished(engine_id: int, request_id: str) -> bytes:
        delta = m.RequestDelta(request_id, [m.CompletionDelta(0, [9], "stop")], True, 0, None)
        return m.encode(m.StepOutputs(engine_id, [request_id], [], [delta], m.EngineStats()))

    forged = [
        (0, [b"\x00 not msgpack"]),
        (1, [b"two", b"parts"]),
        (0, [finished(0, "srv-0")]),  # core-7 speaking for core 0
        (1, [finished(0, "srv-0")]),  # a random identity speaking for core 0
        (0, [finished(7, "srv-0")]),  # core 7 does not exist
        (0, [m.encode(m.Ready(0, 1, "x", 1, 1, 1, 1, 1, "forged"))]),
        (0, [m.encode(m.CoreFailed(0, "forged failure", False))]),
        (0, [msgspec.msgpack.encode({"type": "StepOutputs", "engine_id": "0"})]),
    ]
    result: dict[str, object] = {}

    async def scenario() -> None:
        client = EngineClient(launcher, None, 8)
        await client.start()
        try:
            stream = client.submit([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
            with stream:
                await stream.accepted()
                for which, frames in forged:
                    rogues[which].send_multipart(frames)
                outputs = [out async for out in stream]
            deadline = time.monotonic() + 10
            while client.dropped_messages < len(forged) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            result.update(
                tokens=outputs[-1].outputs[0].token_ids,
                reason=outputs[-1].outputs[0].finish_reason,
                dropped=client.dropped_messages,
                healthy=client.healthy,
                failure=client._cores[0].failure,
                metrics=ServerMetrics(
                    lambda: client.stats, lambda: 0, dropped_messages=lambda: client.dropped_messages
                )
                .render()
                .decode(),
            )
            again = client.submit([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
            with again:
                result["again"] = len([out async for out in again][-1].outputs[0].token_ids)
        finally:
            await client.stop()

    try:
        run_bounded(scenario, 120)
    finally:
        for rogue in rogues:
            rogue.close(0)
        context.term()
    assert len(result["tokens"]) == 40 and result["reason"] == "length"  # the forged "finish" never landed
    assert result["dropped"] == len(forged) and result["healthy"] and result["failure"] is None
    assert result["again"] == 2
    assert f"deepinfer_engine_channel_dropped_messages_total {float(len(forged))}" in result["metrics"]


class StalledCore(CoreHandle):
    """A scripted core in a thread with a 1-message receive high-water mark: it says ready, reads
    nothing until ``resume`` is set, then answers each AddRequest with one finished token and
    records the order of what it received."""

    def __init__(self, engine_id: int, address: str) -> None:
        self.engine_id = engine_id
        self.address = address
        self.resume = threading.Event()
        self.stopped = threading.Event()
        self.received: list[m.ToCore] = []
        self._thread = threading.Thread(target=self._run, name="stalled-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, m.identity(self.engine_id))
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        sock.send(m.encode(m.Ready(self.engine_id, os.getpid(), "stalled", 64, 1, 100, 8, 16, "scripted")))
        try:
            while not self.resume.wait(0.05):
                if self.stopped.is_set():
                    return
            while not self.stopped.is_set():
                if not sock.poll(50):
                    continue
                message = m.decode_to_core(sock.recv())
                self.received.append(message)
                if isinstance(message, m.Shutdown):
                    return
                if isinstance(message, m.AddRequest):
                    rid = message.request_id
                    delta = m.RequestDelta(rid, [m.CompletionDelta(0, [7], "length")], True, 0, None)
                    sock.send(m.encode(m.StepOutputs(self.engine_id, [rid], [], [delta], m.EngineStats())))
        finally:
            sock.close(0)
            context.term()

    @property
    def pid(self) -> int:
        return os.getpid()

    def wait(self) -> str:
        self._thread.join()
        return "exited with code 0"

    def kill(self) -> None:
        self.stopped.set()
        self._thread.join()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


FLOOD = 3000
PROMPT = list(range(5, 105))


def test_a_flood_past_a_tiny_high_water_mark_loses_nothing_and_keeps_order() -> None:
    """The old front sent with NOBLOCK and only logged EAGAIN: every request past the channel's
    capacity was lost and waited forever, and a lost abort let its request run on."""
    cores: list[StalledCore] = []

    def launcher(engine_id: int, address: str) -> CoreHandle:
        cores.append(StalledCore(engine_id, address))
        return cores[0]

    result: dict[str, object] = {}

    async def scenario() -> None:
        client = EngineClient(launcher, None, FLOOD, send_hwm=1, send_timeout_s=60)
        await client.start()
        try:
            params = SamplingParams(max_tokens=1)
            streams = [client.submit(PROMPT, params) for _ in range(FLOOD)]
            result["queued"] = len(client._cores[0].outbox)  # what did not fit in the channel
            streams[-1].close()  # its abort queues behind its AddRequest
            cores[0].resume.set()
            finished = 0
            for stream in streams[:-1]:
                with stream:
                    outputs = [out async for out in stream]
                finished += outputs[-1].finished
            result["finished"] = finished
            deadline = time.monotonic() + 10
            while len(cores[0].received) < FLOOD + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await client.stop(timeout_s=10)

    run_bounded(scenario, 120)
    received = cores[0].received
    adds = [c.request_id for c in received if isinstance(c, m.AddRequest)]
    aborts = [c.request_ids for c in received if isinstance(c, m.AbortRequests)]
    print(f"{result['queued']} of {FLOOD} requests waited in the outbox")
    assert result["queued"] > 0, "the flood fitted in the channel: it proves nothing"
    assert result["finished"] == FLOOD - 1
    assert adds == [f"srv-{i}" for i in range(FLOOD)]  # every one, in order
    assert aborts == [[f"srv-{FLOOD - 1}"]]
    kinds = [type(c).__name__ for c in received]
    assert kinds == ["AddRequest"] * FLOOD + ["AbortRequests", "Shutdown"]  # the abort after its add


def test_a_request_the_channel_cannot_take_in_time_fails_with_a_clear_error() -> None:
    cores: list[StalledCore] = []

    def launcher(engine_id: int, address: str) -> CoreHandle:
        cores.append(StalledCore(engine_id, address))
        return cores[0]

    result: dict[str, object] = {}

    async def scenario() -> None:
        client = EngineClient(launcher, None, FLOOD, send_hwm=1, send_timeout_s=0.5)
        await client.start()
        try:
            streams = [client.submit(PROMPT, SamplingParams(max_tokens=1)) for _ in range(FLOOD)]
            queued = len(client._cores[0].outbox)
            started = time.monotonic()
            # the last one waited behind every other: it cannot have left
            with streams[-1], pytest.raises(EngineDead) as refused:
                await streams[-1].accepted()
            result.update(queued=queued, after=time.monotonic() - started, error=str(refused.value))
            result["in_flight"] = client.num_in_flight
            result["left"] = len(client._cores[0].outbox)
        finally:
            cores[0].stopped.set()
            await client.stop(timeout_s=10)

    run_bounded(scenario, 60)
    assert result["queued"] > 0
    assert result["after"] < 5, result
    assert "did not take the request within 0.5 s" in result["error"]
    # those that were in the channel wait for the core (a few more may have squeezed in meanwhile)
    assert FLOOD - result["queued"] <= result["in_flight"] < FLOOD and result["left"] == 0


def test_a_real_core_flooded_through_a_tiny_high_water_mark_answers_every_request(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), detokenize=False, max_num_seqs=64, **OPTIONS))
    result: dict[str, object] = {}

    async def scenario() -> None:
        client = EngineClient(lambda i, a: CoreThread(engine, i, a), None, 400, send_hwm=1)
        await client.start()
        try:
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            streams = [client.submit(PROMPT[: 5 + i % 20], params) for i in range(400)]
            result["queued"] = len(client._cores[0].outbox)
            lengths = []
            for stream in streams:
                with stream:
                    lengths.append(len([out async for out in stream][-1].outputs[0].token_ids))
            result["lengths"] = lengths
        finally:
            await client.stop()

    run_bounded(scenario, 120)
    assert result["queued"] > 0
    assert result["lengths"] == [2] * 400


def test_a_temporary_folder_too_long_for_a_socket_path_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    long_dir = tmp_path / ("x" * 120)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))

    def launcher(engine_id: int, address: str) -> CoreHandle:
        raise AssertionError("no core may start without a channel")

    async def scenario() -> None:
        with pytest.raises(CoreStartupError, match=r"too long a path.*set TMPDIR to a shorter one"):
            await EngineClient(launcher, None, 1).start()

    run_bounded(scenario, 30)
    assert list(long_dir.iterdir()) == []
