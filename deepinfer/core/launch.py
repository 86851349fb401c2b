"""Starting and watching engine cores.

A :class:`CoreHandle` is one running core as its front sees it: ``wait`` blocks until it ended and
says how, ``kill`` ends it. :class:`CoreProcess` is the real thing: ``python -m deepinfer.core.main``
in a fresh interpreter (no fork of the front's threads or sockets), given a :class:`CoreSpec` as JSON
on its command line; it dies with the front (``PR_SET_PDEATHSIG`` on Linux, and a parent check
everywhere). :class:`CoreThread` runs the same loop on an engine built in this process: for tests
that script the model runner, and for nothing else.
"""

from __future__ import annotations

import abc
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.config import EngineConfig
from deepinfer.logger import get_logger
from deepinfer.threads import thread_environment

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine

logger = get_logger(__name__)


class CoreSpec(BaseModel):
    """What a core process needs to start: its id, the front's socket, its parent, the engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_id: int = Field(ge=0)
    address: str = Field(description="the front's ZeroMQ ROUTER endpoint, e.g. ipc:///tmp/x/engine")
    parent_pid: int = Field(description="the core exits when this process is no longer its parent")
    engine: EngineConfig


class CoreHandle(abc.ABC):
    """One running engine core (see the module docstring)."""

    engine_id: int

    @property
    @abc.abstractmethod
    def pid(self) -> int: ...

    @abc.abstractmethod
    def wait(self) -> str:
        """Block until the core ended; returns how (``"exited with code 1"``, ``"killed by SIGKILL"``)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End the core now (idempotent)."""

    @abc.abstractmethod
    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a core told to shut down; True if it ended."""


class CoreProcess(CoreHandle):
    """A core in its own process (``python -m deepinfer.core.main``)."""

    def __init__(self, spec: CoreSpec) -> None:
        self.engine_id = spec.engine_id
        command = [sys.executable, "-m", "deepinfer.core.main", spec.model_dump_json()]
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=core_environment(os.environ))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait(self) -> str:
        return describe_exit(self._proc.wait())

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def join(self, timeout: float) -> bool:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


class CoreThread(CoreHandle):
    """The core loop on an engine built in this process, in a daemon thread (tests)."""

    def __init__(self, engine: LLMEngine, engine_id: int, address: str) -> None:
        from deepinfer.core.engine_core import EngineCore

        self.engine_id = engine_id
        self._core = EngineCore(engine, engine_id, address, parent_pid=None)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"deepinfer-core-{engine_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._core.serve()
        except Exception as exc:
            self._error = exc

    @property
    def pid(self) -> int:
        return os.getpid()

    def wait(self) -> str:
        self._thread.join()
        return f"failed: {self._error!r}" if self._error else "exited with code 0"

    def kill(self) -> None:
        raise RuntimeError("a core thread cannot be killed; send it Shutdown")

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def core_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A core's environment: the front's, with the engine's OpenMP thread policy
    (:mod:`deepinfer.threads`: ``GOMP_SPINCOUNT=10000`` unless the user chose a wait policy)."""
    return thread_environment(environ)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def spec_from_argv(argv: list[str]) -> CoreSpec:
    if len(argv) != 1:
        raise SystemExit("usage: python -m deepinfer.core.main SPEC_JSON (started by deepinfer serve)")
    return CoreSpec.model_validate(json.loads(argv[0]))
