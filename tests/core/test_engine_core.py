"""The engine core over its real channel (ZeroMQ ROUTER <-> DEALER, msgspec messages), driven by a
bare socket the way a front would: the handshake, token ids that match the in-process engine
exactly, refusals that name their field and leave the core serving, aborts that free every block,
a core process that dies with its front, and a clean start method."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from deepinfer.config import EngineConfig
from deepinfer.core import messages as m
from deepinfer.core.launch import CoreThread, core_environment, describe_exit
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT

OPTIONS = {"num_kv_blocks": 64, "max_model_len": 256}


class Front:
    """A minimal front: one ROUTER socket, blocking receives with a deadline."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="deepinfer-test-")
        self.address = f"ipc://{self.dir}/engine"
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.bind(self.address)

    def send(self, message: m.ToCore, engine_id: int = 0) -> None:
        self.sock.send_multipart([m.identity(engine_id), m.encode(message)])

    def recv(self, timeout_s: float = 30) -> m.FromCore:
        assert self.sock.poll(int(timeout_s * 1000)), "the core sent nothing"
        identity, payload = self.sock.recv_multipart()
        message = m.decode_from_core(payload)
        assert identity == m.identity(message.engine_id)
        return message

    def until_finished(self, request_ids: set[str]) -> tuple[dict[str, list[int]], list[m.StepOutputs]]:
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        seen = []
        while request_ids:
            out = self.recv()
            assert isinstance(out, m.StepOutputs)
            seen.append(out)
            for d in out.deltas:
                tokens[d.request_id] += [t for c in d.completions for t in c.new_token_ids]
                if d.finished:
                    request_ids.discard(d.request_id)
        return tokens, seen

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def core(tiny_model: Path) -> Iterator[tuple[Front, CoreThread, LLMEngine]]:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), detokenize=False, **OPTIONS))
    front = Front()
    handle = CoreThread(engine, 3, front.address)
    try:
        yield front, handle, engine
    finally:
        front.send(m.Shutdown(), 3)
        assert handle.join(30)
        assert handle.wait() == "exited with code 0"
        front.close()


def test_the_core_says_ready_then_streams_the_tokens_the_engine_would_make(core, tiny_model: Path) -> None:
    front, _, engine = core
    ready = front.recv()
    assert isinstance(ready, m.Ready) and ready.engine_id == 3 and ready.pid == os.getpid()
    assert (ready.max_model_len, ready.num_kv_blocks, ready.vocab_size) == (
        256,
        64,
        engine.model_config.vocab_size,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11]}
    for rid, ids in prompts.items():
        front.send(m.AddRequest(rid, ids, params.model_dump_json()), 3)
    tokens, seen = front.until_finished(set(prompts))
    assert sorted(r for out in seen for r in out.accepted) == ["a", "b"]
    assert all(d.first_scheduled_time is not None for out in seen for d in out.deltas)
    expected = LLM(str(tiny_model), **OPTIONS).generate(
        prompt_token_ids=list(prompts.values()), sampling_params=params
    )
    assert [tokens["a"], tokens["b"]] == [o.outputs[0].token_ids for o in expected]
    logprobs = [
        e
        for out in seen
        for d in out.deltas
        if d.request_id == "a"
        for c in d.completions
        for e in c.logprobs
    ]
    assert [e[0][0] for e in logprobs] == tokens["a"] and all(len(e) >= 1 for e in logprobs)
    assert seen[-1].stats.num_free_blocks == seen[-1].stats.num_blocks == 64


def test_refusals_name_their_field_and_the_core_carries_on(core) -> None:
    front, _, _ = core
    front.recv()
    front.send(m.AddRequest("bad-ids", [10**9], SamplingParams().model_dump_json()), 3)
    schema = SamplingParams(max_tokens=4, json_schema={"type": "object", "if": {}}).model_dump_json()
    front.send(m.AddRequest("bad-schema", [5, 6], schema), 3)
    front.send(m.AddRequest("bad-json", [5, 6], '{"temperature": -3}'), 3)
    refusals = {}
    while len(refusals) < 3:
        out = front.recv()
        refusals |= {r.request_id: r for r in out.refusals}
    assert refusals["bad-ids"].invalid and "vocabulary" in refusals["bad-ids"].message
    assert refusals["bad-schema"].field == "json_schema" and refusals["bad-schema"].invalid
    assert refusals["bad-json"].invalid and "temperature" in refusals["bad-json"].message
    front.send(m.AddRequest("ok", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True).model_dump_json()), 3)
    tokens, _ = front.until_finished({"ok"})
    assert len(tokens["ok"]) == 3


def test_an_abort_frees_every_block(core) -> None:
    front, _, _ = core
    front.recv()
    params = SamplingParams(max_tokens=200, ignore_eos=True).model_dump_json()
    front.send(m.AddRequest("long", list(range(5, 60)), params), 3)
    while not any(d.request_id == "long" and d.completions for d in front.recv().deltas):
        pass
    front.send(m.AbortRequests(["long", "unknown"]), 3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = front.recv()
        if out.stats.num_running == 0 and out.stats.num_free_blocks == out.stats.num_blocks:
            return
    raise AssertionError(f"blocks still held after the abort: {out.stats}")


FRONT = textwrap.dedent(
    """
    import sys, time
    from deepinfer.config import EngineConfig
    from deepinfer.core.launch import CoreProcess, CoreSpec
    import os, zmq
    context = zmq.Context(); sock = context.socket(zmq.ROUTER); sock.bind(sys.argv[2])
    core = CoreProcess(CoreSpec(engine_id=0, address=sys.argv[2], parent_pid=os.getpid(),
                                engine=EngineConfig(model=sys.argv[1], num_kv_blocks=16, max_model_len=64)))
    assert sock.poll(300000), "no ready"
    sock.recv_multipart()
    print(core.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_core_process_dies_with_its_front(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    address = f"ipc://{tmp_path}/engine"
    front = subprocess.Popen(
        [sys.executable, "-c", FRONT, str(tiny_model), address], stdout=subprocess.PIPE, text=True, env=env
    )
    core_pid = None
    try:
        core_pid = int(front.stdout.readline())
        os.kill(core_pid, 0)  # it runs
        front.send_signal(signal.SIGKILL)
        front.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise AssertionError("the engine core outlived its front by 10 s")
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
        if core_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(core_pid, signal.SIGKILL)


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(1) == "exited with code 1"


def test_a_core_process_spins_its_idle_openmp_threads_only_briefly_unless_told_otherwise() -> None:
    env = core_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000"}
    assert core_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_step_log_records_each_steps_composition_and_each_arrival(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deepinfer.core.step_log import read_step_log

    monkeypatch.setenv("DEEPINFER_STEP_LOG_DIR", str(tmp_path / "steps"))
    engine = LLMEngine(EngineConfig(model=str(tiny_model), detokenize=False, **OPTIONS))
    front = Front()
    handle = CoreThread(engine, 5, front.address)
    try:
        assert isinstance(front.recv(), m.Ready)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        sent = time.monotonic()
        front.send(m.AddRequest("a", list(range(5, 25)), params.model_dump_json()), 5)
        front.until_finished({"a"})
    finally:
        front.send(m.Shutdown(), 5)
        assert handle.join(30)
        front.close()
    (path,) = (tmp_path / "steps").glob(f"core-{os.getpid()}-5.jsonl")
    adds, steps = read_step_log(path)
    assert adds["a"]["prompt"] == 20 and adds["a"]["t"] >= sent
    # The prompt's 20 tokens, then one decode per further output token; the first token in step one.
    assert [s["work"] for s in steps] == [[[20, 0]], [[1, 20]], [[1, 21]]]
    assert [s["first"] for s in steps] == [["a"], [], []]
    assert all(s["ids"] == ["a"] for s in steps)
    assert all(0 < s["forward_s"] <= s["t1"] - s["t0"] for s in steps)
    assert all(a["t1"] <= b["t0"] for a, b in itertools.pairwise(steps))


def test_a_step_that_scheduled_nothing_is_not_logged(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine step with nothing to run (a request's KV still loading, or the last one just
    finished) must not repeat the step before it in the log: the simulator's validation reads
    each line as a batch that ran."""
    from deepinfer.core.engine_core import EngineCore
    from deepinfer.core.step_log import read_step_log

    monkeypatch.setenv("DEEPINFER_STEP_LOG_DIR", str(tmp_path / "steps"))
    engine = LLMEngine(EngineConfig(model=str(tiny_model), detokenize=False, **OPTIONS))
    core = EngineCore(engine, 6, "inproc://unused", None)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", None, list(range(5, 25)), params)
    while engine.has_unfinished_requests():
        core._step()
    core._step()  # nothing left: schedules nothing
    core._step_log.close()
    _, steps = read_step_log(core._step_log.path)
    assert [s["work"] for s in steps] == [[[20, 0]], [[1, 20]]]
