"""Op tables: which implementation of each interface op a backend provides, and which one is active.

A backend is a module (named by ``Platform.op_backend``) that exposes ``OPS``, an ``OpTable`` filled by
``@OPS.implement`` decorators as its submodules are imported. ``load_backend`` imports the module and
finalises the table: a duplicate op raises at registration, a signature that differs from the
interface raises, and a missing op raises naming it unless the backend declared, with a reason, that
the op runs the reference implementation (which is then logged).

``activate(platform)`` makes one table the process-wide active one; the dispatch functions in
``deepinfer.backends.ops`` call through ``active_ops()``, which activates the current platform on
first use.

Deterministic mode (``activate(platform, deterministic=True)``): every op must then give a row (a token,
or a query token of a request) the same bits whatever else is in its batch. Each backend says, per op,
how: ``@OPS.implement_invariant(how)`` registers a separate batch-invariant formulation used only in
this mode; ``declare_invariant(names, how)`` states that the default implementation already is one;
``declare_variant(names, why)`` states that it is not. A backend that runs the reference
implementation of an op (``use_reference_for``) may still register its own invariant formulation of
it, which deterministic mode then runs. In deterministic mode an op that is not
invariant (or was never declared) runs the reference backend's invariant formulation instead, and the
routing is logged; an op that reads the backend's own KV-cache layout cannot be routed so, and
activation fails naming it. The conformance suite checks every declaration.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
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


# Ops whose reference implementation reads or writes the reference's own KV-cache layout: another
# backend cannot borrow the reference's invariant formulation of these unless it uses that layout too.
LAYOUT_OPS = frozenset({"kv_cache_spec", "kv_cache_write", "kv_cache_gather", "mla_decode"})


@dataclass(frozen=True, slots=True)
class Invariance:
    """How an op runs in deterministic mode on one backend.

    ``formulation``: "default" (the normal implementation, declared batch-invariant), "invariant" (the
    backend's separate batch-invariant formulation) or "reference" (the reference backend's invariant
    formulation, because this backend's is not invariant or was not declared). ``note`` says why the
    result is invariant (or, for "reference", why the backend's own kernel is not)."""

    op: str
    formulation: str
    note: str


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
        self._invariant_impls: dict[str, Callable[..., Any]] = {}
        self._own_invariant: set[str] = set()  # invariant formulations this backend registered itself
        self._invariance: dict[str, tuple[bool, str]] = {}  # name -> (default is invariant, why)
        self._runtime_fallbacks: dict[str, str] = {}  # see fallback_at_runtime
        self._final = False
        self.deterministic = False  # set by ``set_deterministic``; ops then resolve to invariant ones
        self._routes: dict[str, Invariance] = {}
        self._announced = False
        # For backends whose graph-captured ops bake host-side values (Ascend FIA's sequence lengths):
        # a factory of sessions with ``recording()`` (a context manager around capture) and
        # ``update(seq_lens, query_start_loc)`` (host lists, called before each replay).
        self.graph_session: Callable[[], Any] | None = None

    def _check(self, fn: Callable[..., Any], registry: dict[str, Callable[..., Any]]) -> str:
        name = fn.__name__
        spec = interface_ops().get(name)
        if spec is None:
            raise ValueError(
                f"{self.backend}: {name!r} is not an interface op; ops: {sorted(interface_ops())}"
            )
        if name in registry:
            raise DuplicateOpError(f"{self.backend}: op {name!r} registered twice")
        if self._final:
            raise RuntimeError(f"{self.backend}: op table is finalised; cannot add {name!r}")
        if _parameters(fn) != _parameters(spec):
            raise TypeError(
                f"{self.backend}: {name}{inspect.signature(fn)} does not match the interface "
                f"{name}{inspect.signature(spec)}"
            )
        return name

    def implement(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: register ``fn`` as this backend's implementation of the op named ``fn.__name__``."""
        self._impls[self._check(fn, self._impls)] = fn
        return fn

    def implement_invariant(self, how: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register ``fn`` as the op's batch-invariant formulation, used in deterministic mode
        instead of the default implementation; ``how`` says what makes a row's result independent of
        the rest of the batch."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            name = self._check(fn, self._invariant_impls)
            if name in self._invariance:
                raise DuplicateOpError(f"{self.backend}: op {name!r} already declared")
            self._invariant_impls[name] = fn
            self._own_invariant.add(name)
            self._invariance[name] = (False, how)
            return fn

        return register

    def _declare(self, names: list[str], invariant: bool, note: str) -> None:
        unknown = sorted(set(names) - set(interface_ops()))
        if unknown:
            raise ValueError(f"{self.backend}: not interface ops: {unknown}")
        for name in names:
            if name in self._invariance:
                raise DuplicateOpError(f"{self.backend}: op {name!r} already declared")
            self._invariance[name] = (invariant, note)

    def declare_invariant(self, names: list[str], how: str) -> None:
        """Declare that these ops' default implementations are batch-invariant, and why."""
        self._declare(names, True, how)

    def declare_variant(self, names: list[str], why: str) -> None:
        """Declare that these ops' default implementations are NOT batch-invariant (why); in
        deterministic mode they run the reference's invariant formulation."""
        self._declare(names, False, why)

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
                self._impls[name] = reference._impls[name]
                if name in self._own_invariant:
                    pass  # the backend's own invariant formulation of an op it otherwise borrows
                elif name in reference._invariant_impls:
                    self._invariant_impls[name] = reference._invariant_impls[name]
                    self._invariance[name] = reference._invariance[name]
                elif name in reference._invariance:
                    self._invariance[name] = reference._invariance[name]
                logger.warning(
                    "backend %s: op %s runs the reference implementation (%s)",
                    self.backend,
                    name,
                    self._fallbacks[name],
                )
        self._final = True
        return self

    # ------------------------------------------------------------------ deterministic mode
    def invariance(self) -> dict[str, Invariance]:
        """Op name -> how it runs in deterministic mode on this backend (finalises the table)."""
        self.finalize()
        own_layout = self._own_cache_layout()
        routes: dict[str, Invariance] = {}
        for name in sorted(self._impls):
            default_ok, note = self._invariance.get(name, (False, "not declared"))
            if name in self._own_invariant:
                routes[name] = Invariance(name, "invariant", note)
            elif name in self._fallbacks and self.backend != REFERENCE_BACKEND:
                routes[name] = Invariance(name, "reference", f"the reference implementation runs; {note}")
            elif name in self._invariant_impls:
                routes[name] = Invariance(name, "invariant", note)
            elif default_ok:
                routes[name] = Invariance(name, "default", note)
            elif self.backend == REFERENCE_BACKEND:
                raise MissingOpError(f"the reference backend declares no batch-invariant {name}")
            elif name in LAYOUT_OPS and own_layout:
                raise MissingOpError(
                    f"backend {self.backend}: op {name} is not batch-invariant ({note}) and reads the "
                    "backend's own KV-cache layout, so the reference formulation cannot replace it; "
                    "deterministic mode is not available on this backend"
                )
            else:
                routes[name] = Invariance(name, "reference", note)
        return routes

    def _own_cache_layout(self) -> bool:
        """Whether this backend's KV-cache layout differs from the reference's (probed at V3 widths)."""
        if self.backend == REFERENCE_BACKEND:
            return False
        import torch

        probe = (512, 64, torch.float32)
        reference = load_backend(REFERENCE_BACKEND).default_implementation("kv_cache_spec")
        return self._impls["kv_cache_spec"](*probe) != reference(*probe)

    def set_deterministic(self, deterministic: bool) -> OpTable:
        """Switch every op to its deterministic-mode formulation (or back); logs the routing once."""
        if deterministic and not self._announced:
            self._announced = True
            for route in self.invariance().values():
                if route.formulation == "reference" and route.op not in self._fallbacks:
                    logger.warning(
                        "backend %s, deterministic mode: op %s runs the reference's batch-invariant "
                        "formulation (%s)",
                        self.backend,
                        route.op,
                        route.note,
                    )
            logger.info(
                "backend %s: deterministic (batch-invariant) mode\n%s",
                self.backend,
                self.describe_invariance(),
            )
        self.deterministic = deterministic
        return self

    def deterministic_implementation(self, name: str) -> Callable[..., Any]:
        """The op as deterministic mode runs it on this backend."""
        if not self._routes:
            self._routes = self.invariance()
        route = self._routes[name]
        if route.formulation == "reference":
            return load_backend(REFERENCE_BACKEND).deterministic_implementation(name)
        if route.formulation == "invariant":
            return self._invariant_impls[name]
        return self.default_implementation(name)

    def describe_invariance(self) -> str:
        """One line per op: the formulation deterministic mode runs and why it is batch-invariant."""
        return "\n".join(f"  {r.op}: {r.formulation} ({r.note})" for r in self.invariance().values())

    def default_implementation(self, name: str) -> Callable[..., Any]:
        try:
            return self._impls[name]
        except KeyError:
            raise MissingOpError(f"backend {self.backend} has no op {name!r}") from None

    def implementation(self, name: str) -> Callable[..., Any]:
        """The op as the table runs it now (the deterministic formulation in deterministic mode)."""
        if self.deterministic:
            return self.deterministic_implementation(name)
        return self.default_implementation(name)

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


def activate(platform: Platform | None = None, deterministic: bool = False) -> OpTable:
    """Make ``platform``'s op backend (default: the current platform's) the active one, in
    deterministic (batch-invariant) mode or not."""
    global _active
    if platform is None:
        from deepinfer.platform.registry import current_platform

        platform = current_platform()
    _active = load_backend(platform.op_backend).set_deterministic(deterministic)
    return _active


def active_ops() -> OpTable:
    """The active op table; the first call activates the current platform's backend."""
    return _active if _active is not None else activate()


def set_active_ops(table: OpTable | None) -> None:
    """Install a specific table (or forget the active one); for tests and the conformance suite."""
    global _active
    _active = table.finalize() if table is not None else None
