"""Every ``DEEPINFER_*`` environment variable, declared once with its default and meaning.

Read a variable with ``envs.get("DEEPINFER_ACCELERATOR")``; reading an undeclared name is an error, so
the table below is the complete list. Values are read at call time (never cached at import), so tests
and launchers may set them before the engine starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str | None
    parse: Callable[[str], Any]
    doc: str


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {value!r}")


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "DEEPINFER_ACCELERATOR",
            "auto",
            str.strip,
            "Platform to run on: cpu | nvidia | ascend | auto | the name of an out-of-tree platform. "
            "auto picks ascend, then nvidia, then cpu, and logs why. An explicit choice the host cannot "
            "satisfy is an error, never a silent fallback.",
        ),
        EnvVar(
            "DEEPINFER_LOG_LEVEL",
            "INFO",
            str.strip,
            "Log level of the `deepinfer` logger (DEBUG, INFO, WARNING, ERROR).",
        ),
        EnvVar(
            "DEEPINFER_MODEL",
            None,
            str.strip,
            "Default model folder for `python -m deepinfer.run` and `LLM()` when none is given; "
            "unset means the model shipped inside the package.",
        ),
        EnvVar(
            "DEEPINFER_MALLOC_TUNING",
            "1",
            _bool,
            "When true, the command-line entry points re-execute themselves once with glibc malloc "
            "thresholds raised (GLIBC_TUNABLES), which removes page-fault storms on large temporaries, "
            "and with the OpenMP thread policy if torch was imported first. False: they never "
            "re-execute (what a program calling deepinfer.cli.main() in its own process needs).",
        ),
        EnvVar(
            "DEEPINFER_CACHE_DIR",
            "~/.cache/deepinfer",
            str.strip,
            "Where deepinfer keeps files it can recompute (calibrated step cost models).",
        ),
        EnvVar(
            "DEEPINFER_CPU_BACKEND",
            "auto",
            str.strip,
            "Op backend of the cpu platform: fast (deepinfer.backends.cpu, C++ kernels built with the "
            "host's C++ compiler; an error if they cannot be built) | reference (the plain-PyTorch "
            "oracle) | auto (fast when a C++ compiler and ninja are present, else reference with a "
            "warning that says what is missing).",
        ),
        EnvVar(
            "DEEPINFER_CPU_ISA",
            "auto",
            str.strip,
            "Instruction set of the fast CPU backend's quantised-weight kernels (fp8_linear, "
            "grouped_gemm_quant, fused_moe_quant): auto (the best this CPU supports, by cpuid) | avx512 | "
            "avx2 | generic (portable C++). A choice the CPU cannot run is an error when the op runs.",
        ),
        EnvVar(
            "DEEPINFER_EMULATED_NPU",
            "Ascend910B3",
            str.strip,
            "Tests only: the chip the test-only torch_npu emulation (tests/ascend/emulation) reports from "
            "torch.npu.get_device_name, e.g. Ascend910B3 (A2) or Ascend950PR (950).",
        ),
        EnvVar(
            "DEEPINFER_CONFORMANCE_DTYPES",
            "float32,bfloat16",
            str.strip,
            "Conformance suite: comma-separated dtypes to test (float32, bfloat16, float16).",
        ),
        EnvVar(
            "DEEPINFER_CONFORMANCE_FULL",
            "0",
            _bool,
            "Conformance suite: use DeepSeek-V3's real hidden (7168) and expert (2048) sizes in the MoE "
            "cases (device runners); otherwise they are reduced to fit a small CPU host.",
        ),
        EnvVar(
            "DEEPINFER_CONFORMANCE_SHAPES",
            "all",
            str.strip,
            "Conformance suite: 'all' (small and DeepSeek-V3 shapes) or 'small' (for slow targets such as "
            "the Triton interpreter).",
        ),
        EnvVar(
            "DEEPINFER_CONFORMANCE_BACKEND",
            None,
            str.strip,
            "Conformance suite: test this op-backend module (e.g. deepinfer.ops_cuda) instead of the "
            "active platform's, on DEEPINFER_CONFORMANCE_DEVICE. Used to run the Triton kernels under "
            "TRITON_INTERPRET=1 and the Ascend ops against their emulation on a CPU host.",
        ),
        EnvVar(
            "DEEPINFER_CONFORMANCE_DEVICE",
            None,
            str.strip,
            "Conformance suite: torch device for DEEPINFER_CONFORMANCE_BACKEND (default: cpu).",
        ),
        EnvVar(
            "DEEPINFER_TORCH_SPEC",
            None,
            str.strip,
            "build.sh: pip requirement for torch (default torch==2.13.0 on cpu, torch>=2.6,<2.15 elsewhere).",
        ),
        EnvVar(
            "DEEPINFER_TEST_ACCELERATOR",
            "cpu",
            str.strip,
            "Test suite: the platform the tests pin DEEPINFER_ACCELERATOR to (vendor CI runners set it).",
        ),
        EnvVar(
            "DEEPINFER_CLUSTER_SECRET",
            None,
            str.strip,
            "`deepinfer serve`, `router`, `cluster`: the secret the router and its workers share when "
            "--cluster-secret-file is not given (at least 16 characters). The router proves itself to "
            "workers with it; workers need it to register, and accept handoff orders, lease releases and "
            "load polls only with it. `deepinfer cluster` makes one per run.",
        ),
        EnvVar(
            "DEEPINFER_API_KEY",
            None,
            str.strip,
            "`deepinfer serve`, `router`, `cluster`: the API key clients must send (Authorization: Bearer, or "
            "x-api-key) when --api-key is not given; unset means no key is needed. `deepinfer cluster` hands "
            "its key to its workers this way.",
        ),
        EnvVar(
            "DEEPINFER_DETERMINISTIC",
            "0",
            _bool,
            "Default of EngineConfig.deterministic (`--deterministic`): batch-invariant mode, in which a "
            "request's logits and tokens do not depend on what else is in its batch, how its prompt is "
            "chunked, prefix-cache hits or speculative decoding (README: Deterministic mode).",
        ),
        EnvVar(
            "DEEPINFER_SWA_REPLAY",
            "exact",
            str.strip,
            "KV store, models with sliding-window layers: how a prefix hit that lacks the window's SWA "
            "state is completed. exact: recompute the receptive field (same result as a cold run); "
            "bounded: recompute only the last swa_replay_tokens (DeepSeek's approximation).",
        ),
        EnvVar(
            "DEEPINFER_NUM_THREADS",
            None,
            int,
            "Intra-op CPU threads for torch; unset leaves torch's default (the number of cores).",
        ),
        EnvVar(
            "DEEPINFER_STEP_LOG_DIR",
            None,
            str.strip,
            "When set, every engine core appends its step log (each step's composition and times, each "
            "request's arrival at the core; deepinfer.core.step_log) to a JSON-lines file in this folder.",
        ),
        EnvVar(
            "DEEPINFER_DP_CHECK_COLLECTIVES",
            "0",
            _bool,
            "Data-parallel debug mode: after every step the ranks compare a digest of the collectives each "
            "issued and fail, naming the ranks, when they differ.",
        ),
    )
}


def get(name: str) -> Any:
    """Return the parsed value of a declared variable, or its default (``None`` when it has none)."""
    try:
        var = ENV_VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared deepinfer environment variable") from None
    raw = os.environ.get(name, var.default)
    if raw is None:
        return None
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is invalid: {exc}") from None
