"""Chip facts: one data table, one row per chip, each with the source of its figures.

Consumers: the cost model and cluster planner (peak rates, bandwidth), the platform layer (node role),
benchmarks (fraction of the physical limit). Figures are vendor datasheet values for dense math (no
structured sparsity); ``None`` means the chip has no such datatype in hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

GB = 10**9
TB = 10**12


class NodeRole(str, Enum):
    """What a node of this chip is best used for in a disaggregated deployment."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class ChipFacts:
    key: str
    vendor: str
    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    interconnect: str
    interconnect_bytes_per_s: float
    role: NodeRole
    source: str


CHIPS: dict[str, ChipFacts] = {
    c.key: c
    for c in (
        ChipFacts(
            key="ascend950pr",
            vendor="huawei",
            name="Ascend 950PR",
            hbm_bytes=128 * GB,
            hbm_bytes_per_s=1.6 * TB,
            bf16_tflops=500.0,
            fp8_tflops=1000.0,
            interconnect="UB (Lingqu) supernode link",
            interconnect_bytes_per_s=2.0 * TB,
            role=NodeRole.PREFILL,
            source="Huawei Connect 2025 roadmap as reported by secondary sources (HiBL 1.0 128 GB 1.6 TB/s, "
            "FP8 ~1 PFLOPS, 2 TB/s interconnect); bf16 taken as half of FP8 (not published)",
        ),
        ChipFacts(
            key="ascend950dt",
            vendor="huawei",
            name="Ascend 950DT",
            hbm_bytes=144 * GB,
            hbm_bytes_per_s=4.0 * TB,
            bf16_tflops=500.0,
            fp8_tflops=1000.0,
            interconnect="UB (Lingqu) supernode link",
            interconnect_bytes_per_s=2.0 * TB,
            role=NodeRole.DECODE,
            source="Huawei Connect 2025 roadmap as reported by secondary sources (HiZQ 2.0 144 GB 4 TB/s, "
            "same die as 950PR); bf16 taken as half of FP8 (not published)",
        ),
        ChipFacts(
            key="ascend910c",
            vendor="huawei",
            name="Ascend 910C (Atlas A3)",
            hbm_bytes=128 * GB,
            hbm_bytes_per_s=3.2 * TB,
            bf16_tflops=752.0,
            fp8_tflops=None,
            interconnect="HCCS",
            interconnect_bytes_per_s=392 * GB,
            role=NodeRole.BOTH,
            source="Public reports of the Atlas 900 A3 SuperPoD (two 910B-class dies per package); no FP8",
        ),
        ChipFacts(
            key="ascend910b",
            vendor="huawei",
            name="Ascend 910B (Atlas A2)",
            hbm_bytes=64 * GB,
            hbm_bytes_per_s=1.6 * TB,
            bf16_tflops=376.0,
            fp8_tflops=None,
            interconnect="HCCS",
            interconnect_bytes_per_s=392 * GB,
            role=NodeRole.BOTH,
            source="Public Atlas 800T A2 specifications (910B3/B4 class); no FP8",
        ),
        ChipFacts(
            key="sm100",
            vendor="nvidia",
            name="B200 / GB200 (Blackwell, SM100)",
            hbm_bytes=180 * GB,
            hbm_bytes_per_s=8.0 * TB,
            bf16_tflops=2250.0,
            fp8_tflops=4500.0,
            interconnect="NVLink 5",
            interconnect_bytes_per_s=1.8 * TB,
            role=NodeRole.BOTH,
            source="NVIDIA DGX B200 datasheet (1,440 GB and 64 TB/s per 8 GPUs; dense = half the sparse "
            "figures: 2.25 PF bf16, 4.5 PF fp8 per GPU)",
        ),
        ChipFacts(
            key="sm90",
            vendor="nvidia",
            name="H100 / H200 SXM (Hopper, SM90)",
            hbm_bytes=141 * GB,
            hbm_bytes_per_s=4.8 * TB,
            bf16_tflops=989.0,
            fp8_tflops=1979.0,
            interconnect="NVLink 4",
            interconnect_bytes_per_s=900 * GB,
            role=NodeRole.BOTH,
            source="NVIDIA H200 SXM datasheet (141 GB HBM3e, 4.8 TB/s; dense bf16 989 TF, fp8 1,979 TF; "
            "H100 SXM: 80 GB, 3.35 TB/s, same math rates)",
        ),
        ChipFacts(
            key="sm80",
            vendor="nvidia",
            name="A100 SXM (Ampere, SM80)",
            hbm_bytes=80 * GB,
            hbm_bytes_per_s=2.039 * TB,
            bf16_tflops=312.0,
            fp8_tflops=None,
            interconnect="NVLink 3",
            interconnect_bytes_per_s=600 * GB,
            role=NodeRole.BOTH,
            source="NVIDIA A100 80GB SXM datasheet (2,039 GB/s, 312 TF dense bf16, no fp8)",
        ),
        ChipFacts(
            key="cpu",
            vendor="generic",
            name="CPU host",
            hbm_bytes=0,
            hbm_bytes_per_s=20 * GB,
            bf16_tflops=0.2,
            fp8_tflops=None,
            interconnect="loopback / Ethernet",
            interconnect_bytes_per_s=1.25 * GB,
            role=NodeRole.BOTH,
            source="Order-of-magnitude figures for a 2-core x86 VM (AVX-512); memory size is read from "
            "the host at run time (hbm_bytes 0 = not applicable)",
        ),
    )
}


def chip_facts(key: str) -> ChipFacts:
    """Return the row for ``key``; an unknown key names the known ones."""
    try:
        return CHIPS[key]
    except KeyError:
        raise KeyError(f"no chip facts for {key!r}; known chips: {', '.join(sorted(CHIPS))}") from None


# --------------------------------------------------------------------------- deployment SKUs
# What the cluster simulator and planner (deepinfer.sim) need beyond a chip's own facts: the product a
# deployment rents (a chip in a given system), its scale-up domain (how many chips share the fast
# link, which bounds an EP group before traffic crosses the slower scale-out network), the scale-out
# bandwidth per chip, and a rental price where one is published (None: the planner asks for one).


@dataclass(frozen=True, slots=True)
class SkuFacts:
    key: str
    chip: str  # key into CHIPS
    name: str
    scale_up_chips: int  # chips on one NVLink / UB domain
    scale_out_bytes_per_s: float  # per chip, across domains (RDMA NICs)
    usd_per_chip_hour: float | None
    source: str


SKUS: dict[str, SkuFacts] = {
    s.key: s
    for s in (
        SkuFacts(
            "gb200", "sm100", "GB200 NVL72", 72, 100 * GB, 10.582,
            "NVIDIA GB200 NVL72 spec (72 GPUs on one NVLink 5 domain; ConnectX-8 800 Gb/s per GPU); price: "
            "AWS EC2 Capacity Blocks, u-p6e-gb200x72, US East (Dallas) Local Zone, US$10.582 per "
            "accelerator-hour (seeds 002/003)",
        ),
        SkuFacts(
            "b200", "sm100", "HGX B200 (8 GPUs)", 8, 50 * GB, 14.208,
            "NVIDIA DGX B200 datasheet (8 GPUs per NVLink domain, 400 Gb/s ConnectX-7 per GPU); price: AWS "
            "EC2 Capacity Blocks, p6-b200.48xlarge, US$14.208 per accelerator-hour (seeds 002/003)",
        ),
        SkuFacts(
            "h200", "sm90", "HGX H200 (8 GPUs)", 8, 50 * GB, None,
            "NVIDIA HGX H200 (8 GPUs per NVLink 4 domain, 400 Gb/s per GPU); no rental price in our sources",
        ),
        SkuFacts(
            "ascend950pr", "ascend950pr", "Ascend 950PR (Atlas 950 SuperPoD)", 8192, 2.0 * TB, None,
            "Huawei Connect 2025 roadmap (secondary sources): Atlas 950 SuperPoD joins up to 8,192 chips on "
            "the UB link, so EP never leaves the fast domain; no rental price published",
        ),
        SkuFacts(
            "ascend950dt", "ascend950dt", "Ascend 950DT (Atlas 950 SuperPoD)", 8192, 2.0 * TB, None,
            "Huawei Connect 2025 roadmap (secondary sources), as for 950PR; no rental price published",
        ),
        SkuFacts(
            "cpu", "cpu", "this CPU host", 1, 1.25 * GB, None,
            "a single host; EP across hosts runs over Ethernet (10 Gb/s assumed)",
        ),
    )
}  # fmt: skip


def sku_facts(key: str) -> SkuFacts:
    """Return the deployment SKU ``key``; an unknown key names the known ones."""
    try:
        return SKUS[key]
    except KeyError:
        raise KeyError(f"unknown chip {key!r}; known chips: {', '.join(sorted(SKUS))}") from None
