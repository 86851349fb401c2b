"""Build and load the fast CPU backend's C++ kernels (``csrc/*.cpp``, one library): torch ops and the
CPU graph replayer.

The kernels are compiled with torch's extension tooling (``torch.utils.cpp_extension``: a C++17
compiler and ninja) into ``DEEPINFER_CACHE_DIR/cpu_ops/<key>``, where the key digests the sources and
their shared headers, the torch version and this CPU's instruction-set flags (the code is built with
``-march=native``), so a build is reused across processes and runs and redone only when one of those
changes. ``./build.sh`` builds it ahead of time; otherwise the first activation does (about a minute on 2 cores). The
library is a Python extension module: importing it registers the ops in ``torch.ops.deepinfer_cpu``
(``load()``) and gives the ``OpGraph`` class that ``deepinfer.backends.cpu.graph`` replays steps with
(``module()``).

``toolchain_problem()`` says what is missing when the host cannot build them, so the platform can
choose the reference backend loudly (``DEEPINFER_CPU_BACKEND=auto``) or refuse (``=fast``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.logger import get_logger

logger = get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# kernels.cpp (attention, cache, norms, rope), moe.cpp (routing, experts), graph.cpp (graph replay)
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
# -fno-trapping-math lets the compiler vectorise loops with float selects (the clamps in fast_exp):
# it changes no value, only the assumption that floating-point exceptions are never inspected.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_NAME = "deepinfer_cpu_ops"
_lock = threading.Lock()
_module: Any = None


class NativeBuildError(RuntimeError):
    """The C++ kernels of the fast CPU backend could not be built or loaded (the message says why)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX-BF16); without them bf16
    is a storage format that every op converts to float32 and back."""
    flags = set(_cpu_flags().split())
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in (*SOURCES, *HEADERS)),
        torch.__version__.encode(),
        _cpu_flags().encode(),
        " ".join(_FLAGS).encode(),
    ):
        digest.update(part)
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return Path(os.path.expanduser(envs.get("DEEPINFER_CACHE_DIR"))) / "cpu_ops" / build_key()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    """Whether ``target`` holds a finished build: the library, and beside it the SHA-256 its build
    recorded once the library was complete. A library cut short (a build or a copy killed mid-write)
    does not match, and loading it could kill the process (SIGBUS in the dynamic loader)."""
    library, recorded = target / f"{_NAME}.so", target / f"{_NAME}.so.sha256"
    try:
        return library.is_file() and recorded.read_text().strip() == _digest(library)
    except OSError:
        return False


def toolchain_problem() -> str | None:
    """None when the kernels are built already or can be built here; else what is missing."""
    if _intact(build_dir()):
        return None
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja, or the system package)"
    return None


def load() -> Any:
    """Build (if needed) and load the kernels; returns ``torch.ops.deepinfer_cpu``. Idempotent.

    A build holds an exclusive ``flock`` on ``build.flock`` in the build directory: the kernel releases it
    when the holder dies, so a process killed mid-build (kill -9) never blocks later starts. A finished
    build is recorded by its library's SHA-256 and loaded directly, without torch's builder, so other
    checkouts of the same source never rebuild it; anything else in the directory (a killed build's
    objects or truncated library, torch's ``lock`` baton, after which every ``cpp_extension.load`` would
    wait forever) is removed under the lock and the build starts over.
    """
    module()
    return torch.ops.deepinfer_cpu


def module() -> Any:
    """The built extension module (``OpGraph``), loaded as ``load()`` does. Idempotent."""
    global _module
    with _lock:
        if _module is None:
            target = build_dir()
            library = target / f"{_NAME}.so"
            if not _intact(target):
                _build(target)
            try:
                spec = importlib.util.spec_from_file_location(_NAME, library)
                loaded = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(loaded)
            except (ImportError, OSError) as exc:
                raise NativeBuildError(f"loading {library} failed: {exc}") from exc
            _module = loaded
    return _module


def _build(target: Path) -> None:
    problem = toolchain_problem()
    if problem is not None:
        raise NativeBuildError(f"cannot build the fast CPU kernels: {problem}")
    from torch.utils import cpp_extension

    target.mkdir(parents=True, exist_ok=True)
    with open(target / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process may be building: wait for it, not for a corpse
        if _intact(target):
            return
        leftovers = [path for path in target.iterdir() if path.name != "build.flock"]
        if leftovers:  # a build killed part-way (objects or library cut short, torch's baton): start over
            logger.warning("removing an unfinished build of the fast CPU kernels in %s", target)
            for path in leftovers:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        logger.info("building the fast CPU kernels into %s (once per source/torch/CPU)", target)
        try:
            cpp_extension.load(
                name=_NAME,
                sources=[str(path) for path in SOURCES],
                build_directory=str(target),
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=True,
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            raise NativeBuildError(f"building {CSRC} in {target} failed: {exc}") from exc
        # The library is complete: record its digest (written aside, fsynced, renamed into place).
        recorded = target / f"{_NAME}.so.sha256"
        partial = recorded.with_suffix(".tmp")
        with open(partial, "w") as out:
            out.write(_digest(target / f"{_NAME}.so"))
            out.flush()
            os.fsync(out.fileno())
        partial.replace(recorded)


if __name__ == "__main__":  # ./build.sh: python -m deepinfer.backends.cpu.native
    load()
    print(f"fast CPU kernels ready in {build_dir()}")
