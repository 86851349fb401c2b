"""``python -m deepinfer.run`` and the ``deepinfer run`` console script, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
