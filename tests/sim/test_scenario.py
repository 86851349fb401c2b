"""The deepseek-2026 scenario reproduces the published figures from their inputs."""

import json
import subprocess
import sys

import pytest

from deepinfer.sim.scenario import format_scenario, run_scenario


def test_published_figures_within_5_percent() -> None:
    r = run_scenario("deepseek-2026")
    assert r["output_tokens_per_day_ceiling"] == pytest.approx(87e9, rel=0.05)
    assert r["output_tokens_per_day_balanced"] == pytest.approx(69e9, rel=0.05)
    assert r["cluster_rental_usd_per_day"] == pytest.approx(32508, rel=0.05)
    assert r["revenue_to_rental_b200"] == pytest.approx(2.7, rel=0.05)
    assert r["revenue_to_rental_gb200"] == pytest.approx(3.6, rel=0.05)
    # The figures come from the inputs: 64 x 15,700 x 86,400 and 128 x 10.582 x 24.
    inputs = {k: v["value"] for k, v in r["inputs"].items()}
    assert (
        r["output_tokens_per_day_ceiling"]
        == inputs["decode_gpus"] * inputs["decode_tokens_per_s_per_gpu"] * 86400
    )
    assert r["cluster_rental_usd_per_day"] == pytest.approx(128 * inputs["gb200_usd_per_gpu_hour"] * 24)


def test_text_shows_inputs_and_published_values() -> None:
    text = format_scenario(run_scenario("deepseek-2026"))
    assert "decode_tokens_per_s_per_gpu" in text and "8.7e+10" in text and "-0.2%" in text


def test_unknown_scenario() -> None:
    with pytest.raises(ValueError, match="known: deepseek-2026"):
        run_scenario("deepseek-2025")


def test_cli_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "plan", "--scenario", "deepseek-2026", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    for key in (
        "output_tokens_per_day_ceiling",
        "output_tokens_per_day_balanced",
        "cluster_rental_usd_per_day",
    ):
        assert key in result
