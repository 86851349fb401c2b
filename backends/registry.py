"""Op tables: which implementation of each interface op a backend provides, and which one is active.

A backend is a module (named by ``Platform.op_backend``) that exposes ``OPS``, an ``OpTable`` filled by
``@OPS.implement`` decorators as its submodules are imported. ``load_backend`` imports the module and
finalises the table: a duplicate op raises at registration, a signature that differs from the
interface raises, and a missing op raises naming it unless the backend declared, with a reason, that
the op runs the reference implementation (which is then logged).

``activate(platform)`` makes one table the process-wide active one; the dispatch functions in
``deepinfer.backends.ops`` call through ``active_ops()``, which activates the current platform on
first use.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deepinfer.logger import get_logger

if TYPE_CHECKING:
    from deepinfer.platform.interface import Platform

logger = get_logger(__name__)

REFERENCE_BACKEND = "deepinfer.backends.reference"


PORTABLE_OPS: set[str] = set()


def portable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an interface op whose reference implementation is plain, device-generic torch: a backend
    may implement it, and otherwise runs the reference one (logged at activation like any fallback)."""
    PORTABLE_OPS.add(fn.__name__)
    return fn


class DuplicateOpError(ValueError):
    """An op was registered twice in one backend."""


class MissingOpError(RuntimeError):
    """A backend does not implement some interface ops (the message names them)."""


def interface_ops() -> dict[str, Callable[..., Any]]:
    """Name -> interface function, for every op declared in ``deepinfer.backends.ops``."""
    from deepinfer.backends import ops

    return {
        name: fn
        for name, fn in vars(ops).items()
        if inspect.isfunction(fn) and fn.__module__ == ops.__name__ and not name.startswith("_")
    }


def _parameters(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


class OpTable:
    """The implementations of one backend, looked up as attributes (``table.rms_norm(...)``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._impls: dict[str, Callable[..., Any]] = {}
        self._fallbacks: dict[str, str] = {}
        self._runtime_fallbacks: dict[str, str] = {}  # see fallback_at_runtime
        self._final = False
        # For backends whose graph-captured ops bake host-side values (Ascend FIA's sequence lengths):
        # a factory of sessions with ``recording()`` (a context manager around capture) and
        # ``update(seq_lens, query_start_loc)`` (host lists, called before each replay).
        self.graph_session: Callable[[], Any] | None = None

    def implement(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: register ``fn`` as this backend's implementation of the op named ``fn.__name__``."""
        name = fn.__name__
        spec = interface_ops().get(name)
        if spec is None:
            raise ValueError(
                f"{self.backend}: {name!r} is not an interface op; ops: {sorted(interface_ops())}"
            )
        if name in self._impls:
            raise DuplicateOpError(f"{self.backend}: op {name!r} registered twice")
        if self._final:
            raise RuntimeError(f"{self.backend}: op table is finalised; cannot add {name!r}")
        if _parameters(fn) != _parameters(spec):
            raise TypeError(
                f"{self.backend}: {name}{inspect.signature(fn)} does not match the interface "
                f"{name}{inspect.signature(spec)}"
            )
        self._impls[name] = fn
        return fn

    def use_reference_for(self, names: list[str], reason: str) -> None:
        """Declare that these ops run the reference implementation on this backend, and why."""
        unknown = sorted(set(names) - set(interface_ops()))
        if unknown:
            raise ValueError(f"{self.backend}: not interface ops: {unknown}")
        for name in names:
            self._fallbacks[name] = reason

    def fallback_at_runtime(self, name: str, reason: str) -> None:
        """Declare that op ``name``, implemented by this backend, runs the reference implementation on
        this host after all, for ``reason`` found only when it first ran (a native kernel that is not
        built, does not load, or failed its self-test). Logged as a WARNING once per reason; listed by
        ``reference_fallbacks`` and ``describe()``. Cheap to call on every use."""
        if self._runtime_fallbacks.get(name) == reason:
            return
        if name not in self._impls:
            raise ValueError(f"{self.backend}: {name!r} is not an op this backend implements")
        self._runtime_fallbacks[name] = reason
        logger.warning("backend %s: op %s runs the reference implementation (%s)", self.backend, name, reason)

    def finalize(self) -> OpTable:
        """Check completeness (idempotent). Raises MissingOpError naming every missing op."""
        if self._final:
            return self
        interface = interface_ops()  # importing the interface also fills PORTABLE_OPS
        for name in sorted(set(PORTABLE_OPS) - set(self._impls) - set(self._fallbacks)):
            self._fallbacks[name] = "portable op: its reference implementation runs on any torch device"
        missing = sorted(set(interface) - set(self._impls) - set(self._fallbacks))
        if missing:
            raise MissingOpError(f"backend {self.backend} does not implement: {', '.join(missing)}")
        fallback_names = sorted(n for n in self._fallbacks if n not in self._impls)
        if fallback_names:
            reference = load_backend(REFERENCE_BACKEND)
            for name in fallback_names:
                self._impls[name] = reference.implementation(name)
                logger.warning(
                    "backend %s: op %s runs the reference implementation (%s)",
                    self.backend,
                    name,
                    self._fallbacks[name],
                )
        self._final = True
        return self

    def implementation(self, name: str) -> Callable[..., Any]:
        try:
            return self._impls[name]
        except KeyError:
            raise MissingOpError(f"backend {self.backend} has no op {name!r}") from None

    @property
    def reference_fallbacks(self) -> dict[str, str]:
        """Op name -> reason, for ops this backend declared to run the reference implementation (at
        registration, or at run time on this host)."""
        return {**self._fallbacks, **self._runtime_fallbacks}

    def describe(self) -> str:
        """One line: the backend, its op count, and each reference fallback with its reason."""
        fallbacks = self.reference_fallbacks
        listed = "; ".join(f"{name} ({why})" for name, why in sorted(fallbacks.items()))
        return f"{self.backend}: {len(self._impls)} ops" + (
            f", reference implementation for {listed}" if fallbacks else ", no reference fallbacks"
        )

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.implementation(name)

    def __repr__(self) -> str:
        return f"OpTable({self.backend!r}, {len(self._impls)} ops)"


def load_backend(module_name: str) -> OpTable:
    """Import a backend module and return its finalised ``OPS`` table."""
    module = importlib.import_module(module_name)
    table = getattr(module, "OPS", None)
    if not isinstance(table, OpTable):
        raise TypeError(f"backend module {module_name} has no OPS op table")
    return table.finalize()


_active: OpTable | None = None


def activate(platform: Platform | None = None) -> OpTable:
    """Make ``platform``'s op backend (default: the current platform's) the active one."""
    global _active
    if platform is None:
        from deepinfer.platform.registry import current_platform

        platform = current_platform()
    _active = load_backend(platform.op_backend)
    return _active


def active_ops() -> OpTable:
    """The active op table; the first call activates the current platform's backend."""
    return _active if _active is not None else activate()


def set_active_ops(table: OpTable | None) -> None:
    """Install a specific table (or forget the active one); for tests and the conformance suite."""
    global _active
    _active = table.finalize() if table is not None else None
