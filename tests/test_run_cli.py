"""``python -m deepinfer.run`` and the ``deepinfer run`` console script, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT


def run_cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.run", *args],
        cwd=REPO_ROOT, input=stdin, capture_output=True, text=True, timeout=300,
        env={**os.environ, "DEEPINFER_ACCELERATOR": "cpu"},
    )  # fmt: skip


def test_json_output_for_prompts_from_arguments_and_stdin(tiny_model: Path) -> None:
    proc = run_cli(
        ["--model", str(tiny_model), "--max-tokens", "6", "--json", "def f(x):", "-"], stdin="class A:"
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "class A:"]
    for r in rows:
        assert len(r["token_ids"]) == 6 and r["finish_reason"] == "length"
        assert r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0


def test_human_output_names_platform_model_and_speed(tiny_model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def g():\nimport os\n")
    proc = run_cli(["--model", str(tiny_model), "--max-tokens", "4", "--file", str(prompts), "--stream"])
    assert proc.returncode == 0, proc.stderr
    assert "platform cpu" in proc.stderr and f"model {tiny_model.name}" in proc.stderr
    assert proc.stderr.count("TTFT") == 2 and "tok/s" in proc.stderr
    assert proc.stdout.startswith("def g():")


def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_cli(["--model", str(tmp_path / "nope"), "hi"])
    assert proc.returncode != 0
    assert "is not a folder" in proc.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "deepinfer"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "run" in proc.stdout


def deepinfer(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "DEEPINFER_ACCELERATOR": "cpu", "DEEPINFER_MALLOC_TUNING": "0"},
    )  # fmt: skip


def one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    """A user error: exit code 2, one line on stderr naming the problem, nothing loaded."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in proc.stderr and "engine ready" not in proc.stderr


def test_run_errors_are_one_line_before_the_model_loads(tiny_model: Path, tmp_path: Path) -> None:
    one_line_error(
        deepinfer(["run", "--model", str(tiny_model), "--temperature", "-1", "hi"]), "--temperature"
    )
    one_line_error(
        deepinfer(["run", "--model", str(tiny_model), "--file", str(tmp_path / "missing.txt")]), "--file"
    )
    one_line_error(deepinfer(["run", "--model", str(tiny_model), "--max-tokens", "x", "hi"]), "--max-tokens")


def test_serve_errors_are_one_line_before_the_model_loads(tiny_model: Path) -> None:
    import socket

    one_line_error(deepinfer(["serve", "--model", str(tiny_model), "--port", "99999"]), "--port", "99999")
    one_line_error(deepinfer(["serve", "--model", str(tiny_model), "--api-key", ""]), "--api-key")
    one_line_error(deepinfer(["serve", "--model", str(tiny_model), "--drain-timeout", "-1"]), "drain")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        start = time.monotonic()
        proc = deepinfer(["serve", "--model", str(tiny_model), "--port", port])
        one_line_error(proc, "cannot listen", port)
        assert time.monotonic() - start < 20  # no model was loaded first


def test_serve_warns_about_a_public_address_without_a_key(tiny_model: Path) -> None:
    import socket

    with socket.socket() as busy:  # the port is taken, so the command stops right after the warning
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        proc = deepinfer(
            ["serve", "--model", str(tiny_model), "--host", "0.0.0.0", "--port", str(busy.getsockname()[1])]
        )
    assert proc.returncode == 2 and "without an API key" in proc.stderr and "cannot listen" in proc.stderr


def test_help_shows_the_defaults() -> None:
    proc = deepinfer(["serve", "--help"])
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "(default: 8000)" in text and "(default: 30.0)" in text and "(default: 1024)" in text
    run_help = " ".join(deepinfer(["run", "--help"]).stdout.split())
    assert "(default: 128)" in run_help and "(default: 0.0)" in run_help


def test_ignore_eos_generates_every_token(tiny_model: Path) -> None:
    """``--ignore-eos`` (what bench/busy_host.py uses for a fixed token count) runs past EOS."""
    proc = run_cli(["--model", str(tiny_model), "--max-tokens", "24", "--ignore-eos", "--json", "x"])
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["generated_tokens"] == 24 and row["finish_reason"] == "length"
