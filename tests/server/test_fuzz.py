"""Fuzzing. Schema-driven: schemathesis generates requests from the server's own OpenAPI document,
valid ones (which run through the engine) and invalid ones (which must be refused cleanly), and
no response may be a 5xx, nor a stream that ends in an internal error. The model is replaced by ``NullModel`` so that generation costs nothing.

The default run sends about 100 cases; the ``slow`` run at least 500. Hostile content: hypothesis
sends text with lone surrogates, NULs and control-token strings, and extreme sampling values, to all
four APIs (120 cases).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


# ---------------------------------------------------------------------------- hostile text and values
CONTROL_TEXTS = ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "<｜begin▁of▁sentence｜>"]  # fmt: skip
PIECES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["\ud800", "\udfff", "\ud83d\ude00", "\x00", "\x1b[2J", "\u202e", "\ufffd", "\\u0000", "𝔘"]
    ),
    st.sampled_from(CONTROL_TEXTS),
)
TEXT = st.lists(PIECES, max_size=6).map("".join)
FLOATS = st.sampled_from(
    [0.0, 1e-300, 1e-40, 1e-7, 0.5, 1.0, 2.0, 100.0, 101.0, -1.0, 1e308, float("nan"), float("inf")]
)
INTS = st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 50, 2**31, 2**64])


@st.composite
def hostile_request(draw) -> tuple[str, dict]:
    """A request to one of the four APIs: hostile text wherever text goes, extreme sampling values."""
    api = draw(st.sampled_from(["chat", "completions", "responses", "messages"]))
    text, system = draw(TEXT), draw(TEXT)
    values = {k: draw(FLOATS) for k in draw(st.sets(st.sampled_from(["temperature", "top_p", "min_p"])))}
    if draw(st.booleans()):
        values["top_k"] = draw(INTS)
    if draw(st.booleans()):
        values["seed"] = draw(INTS)
    stream = draw(st.booleans())
    limit = draw(st.sampled_from([1, 2, 4, 0, -1, 10**12]))
    if api == "chat":
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                "max_tokens": limit, "stop": [draw(TEXT) or "x"], **values}  # fmt: skip
        return "/v1/chat/completions", {**body, "model": MODEL_NAME, "stream": stream}
    if api == "completions":
        prompt = draw(st.one_of(st.just(text), st.lists(TEXT, max_size=3), st.lists(INTS, max_size=4)))
        return "/v1/completions", {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": limit,
            "stream": stream,
            **values,
        }
    values.pop("min_p", None)
    values.pop("seed", None)
    if api == "responses":
        values.pop("top_k", None)
        body = {"instructions": system, "input": text, "max_output_tokens": limit, **values}
        return "/v1/responses", {**body, "model": MODEL_NAME, "stream": stream}
    body = {"system": system, "messages": [{"role": "user", "content": text}], "max_tokens": limit,
            "stop_sequences": [draw(TEXT) or "x"], **values}  # fmt: skip
    return "/v1/messages", {**body, "model": MODEL_NAME, "stream": stream}


def test_hostile_text_and_extreme_values_never_break_the_server(fuzz_server: ServerHandle) -> None:
    """Surrogates, NULs, control-token texts, NaN and huge numbers, in all four APIs: never a 5xx,
    never an internal error in a stream, and the engine still serves afterwards."""
    failures: list[str] = []
    statuses: dict[int, int] = {}
    with requests.Session() as session:

        @settings(max_examples=120, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(request=hostile_request())
        def check(request: tuple[str, dict]) -> None:
            path, body = request
            data = json.dumps(body, ensure_ascii=True, allow_nan=True)  # surrogates as \\uXXXX escapes
            response = session.post(fuzz_server.url + path, data=data, timeout=60,
                                    headers={"content-type": "application/json"})  # fmt: skip
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500 or "internal error" in response.text:
                failures.append(f"{path} {data[:300]} -> {response.status_code} {response.text[:300]}")

        check()
    assert not failures, f"{len(failures)} server errors, e.g. {failures[:3]}"
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses  # both paths were exercised
    assert requests.get(f"{fuzz_server.url}/health", timeout=5).status_code == 200
    ok = requests.post(
        f"{fuzz_server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    )
    assert ok.status_code == 200
    fuzz_server.wait_idle()
