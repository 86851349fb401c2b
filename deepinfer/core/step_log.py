"""An engine core's step log: what each served step computed and how long it took.

Written by :class:`~deepinfer.core.engine_core.EngineCore` when ``DEEPINFER_STEP_LOG_DIR`` names a
folder: one JSON-lines file per core process (``core-<pid>-<engine id>.jsonl``), one line per event,
flushed as it is written (the core may be killed at any time). Read by the simulator's validation
(``deepinfer.sim.validation``), which fits the step cost model to real served steps and measures the
front's latency. Times are ``time.monotonic()`` seconds, the clock ``time.perf_counter()`` also reads
on Linux, so a client on the same host can compare its own timestamps with them.

Events:

- ``{"add": id, "t": s, "prompt": tokens}``: the core took a request (from its queue, between steps).
- ``{"t0": s, "t1": s, "forward_s": s, "work": [[new, cached], ...], "ids": [id, ...],
  "first": [id, ...]}``: one step that ran a batch (a ``step()`` that scheduled nothing is not
  logged): the engine's ``step()`` ran from ``t0`` to ``t1``, of which
  ``forward_s`` was the model runner's (inputs, forward, sampling); ``work`` holds each scheduled
  request's new and already-cached tokens (``ids`` in the same order); ``first`` lists the requests
  whose first output token this step produced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO


class StepLog:
    """One core's log file (see the module docstring); ``close`` when the core stops."""

    def __init__(self, folder: Path, engine_id: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"core-{os.getpid()}-{engine_id}.jsonl"
        self._file: IO[str] = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed by close())

    def added(self, request_id: str, t: float, prompt_tokens: int) -> None:
        self._write({"add": request_id, "t": t, "prompt": prompt_tokens})

    def step(
        self, t0: float, t1: float, forward_s: float, work: list[tuple[int, int]], ids: list[str],
        first: list[str],
    ) -> None:  # fmt: skip
        self._write({"t0": t0, "t1": t1, "forward_s": forward_s, "work": work, "ids": ids, "first": first})

    def close(self) -> None:
        self._file.close()

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")


def read_step_log(path: Path) -> tuple[dict[str, dict], list[dict]]:
    """The adds (request id -> event) and the steps (in order) of one log file."""
    adds, steps = {}, []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if "add" in event:
            adds[event["add"]] = event
        else:
            steps.append(event)
    return adds, steps
