"""Chip detection from device names and capabilities, and the chip facts table."""

from __future__ import annotations

import pytest

from deepinfer.platform.ascend import chip_from_device_name
from deepinfer.platform.chips import CHIPS, NodeRole, chip_facts
from deepinfer.platform.nvidia import chip_for_capability


@pytest.mark.parametrize(
    ("name", "chip", "role"),
    [
        ("Ascend950PR", "ascend950pr", NodeRole.PREFILL),
        ("Ascend 950DT", "ascend950dt", NodeRole.DECODE),
        ("Ascend910_9392", "ascend910c", NodeRole.BOTH),
        ("Ascend910B3", "ascend910b", NodeRole.BOTH),
    ],
)
def test_ascend_chip_and_role_from_device_name(name: str, chip: str, role: NodeRole) -> None:
    assert chip_from_device_name(name) == chip
    assert chip_facts(chip).role is role


def test_unknown_ascend_device_is_not_guessed() -> None:
    assert chip_from_device_name("Ascend310P3") is None


@pytest.mark.parametrize(
    ("cap", "chip"),
    [((10, 0), "sm100"), ((9, 0), "sm90"), ((8, 0), "sm80"), ((8, 6), "sm80"), ((7, 5), None)],
)
def test_nvidia_chip_from_capability(cap: tuple[int, int], chip: str | None) -> None:
    assert chip_for_capability(*cap) == chip


def test_every_chip_row_is_complete_and_sourced() -> None:
    for key in ("ascend950pr", "ascend950dt", "sm100", "sm90", "sm80", "cpu"):
        row = CHIPS[key]
        assert row.key == key
        assert row.hbm_bytes_per_s > 0 and row.bf16_tflops > 0
        assert len(row.source) > 20
    assert CHIPS["sm80"].fp8_tflops is None  # Ampere has no FP8 tensor cores
    with pytest.raises(KeyError, match="known chips"):
        chip_facts("tpu")
