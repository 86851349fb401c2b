"""Schema-driven fuzzing: schemathesis generates requests from the server's own OpenAPI document,
valid ones (which run through the engine) and invalid ones (which must be refused cleanly), and
no response may be a 5xx, nor a stream that ends in an internal error. The model is replaced by ``NullModel`` so that generation costs nothing.

The default run sends about 100 cases; the ``slow`` run at least 500.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import MODEL_NAME, NullModel, ServerHandle, start_server


@pytest.fixture(scope="module")
def fuzz_server(deepseek_model: Path) -> Iterator[ServerHandle]:
    engine = {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 256}
    yield from start_server(deepseek_model, runner=NullModel, engine=engine, max_request_bytes=1 << 20)


def serve_model(case: schemathesis.Case) -> schemathesis.Case:
    """Most generated bodies should name the served model (random names only exercise the 404)."""
    model = case.body.get("model") if isinstance(case.body, dict) else None
    if isinstance(model, str) and zlib.crc32(model.encode()) % 8:
        case.body["model"] = MODEL_NAME
    return case


def fuzz(server: ServerHandle, cases_per_operation_and_mode: int) -> int:
    """Run the fuzzer; returns the number of requests sent. Fails on any 5xx."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    sent = 0
    statuses: dict[int, int] = {}
    failures: list[str] = []
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            has_body = operation.method.upper() == "POST"  # the GET routes take no input to corrupt
            for mode in (
                (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,)
            ):

                @settings(
                    max_examples=cases_per_operation_and_mode,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=operation.as_strategy(generation_mode=mode).map(serve_model))
                def check(case: schemathesis.Case) -> None:
                    nonlocal sent
                    response = case.call(base_url=server.url, session=session, timeout=60)
                    sent += 1
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    if response.status_code >= 500 or "internal error" in response.text:
                        failures.append(f"{case.method} {case.path} {case.body!r} -> {response.text[:300]}")

                check()
    assert not failures, f"{len(failures)} server errors, e.g. {failures[:3]}"
    print(f"fuzzing: {sent} requests, status codes {dict(sorted(statuses.items()))}")
    server.wait_idle()
    return sent


def test_fuzzing_finds_no_server_error(fuzz_server: ServerHandle) -> None:
    assert fuzz(fuzz_server, 12) >= 90


@pytest.mark.slow
def test_fuzzing_500_cases_finds_no_server_error(fuzz_server: ServerHandle) -> None:
    assert fuzz(fuzz_server, 70) >= 500
