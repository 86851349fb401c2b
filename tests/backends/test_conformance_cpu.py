"""The conformance suite passes for cpu when run the way vendors run it, and writes a JUnit report."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_suite_passes_for_cpu_with_junit_report(tmp_path: Path) -> None:
    report = tmp_path / "conformance.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "deepinfer.backends.testing",
         f"--junitxml={report}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "DEEPINFER_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("tests", "0")) >= 90
    assert int(suite.get("failures", "1")) == 0 and int(suite.get("errors", "1")) == 0
    names = {case.get("name", "").split("[")[0] for case in suite.iter("testcase")}
    assert {"test_mla_decode", "test_mla_prefill", "test_fused_moe", "test_sample"} <= names
