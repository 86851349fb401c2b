"""The fast CPU backend's op table (see the package docstring for what it implements and why)."""

from deepinfer.backends.registry import OpTable

OPS = OpTable("deepinfer.backends.cpu.backend")

from deepinfer.backends.cpu import attention, cache, deterministic, linear, moe, norm, quant, sampling  # noqa: E402  (submodules register into OPS)

OPS.use_reference_for(
    ["ep_dispatch", "ep_combine", "sample"],
    "already vectorised torch without loops; a kernel would save only dispatch time",
)
OPS.use_reference_for(["kv_cache_gather"], "one index_select reads each row once")
# Deterministic mode: the invariant attention kernel and grouped products, and the kernels declared
# invariant, are in ``deterministic``.
OPS.declare_invariant(["kv_cache_spec", "kv_cache_write"], "the reference's layout; row copies")

__all__ = ["OPS", "attention", "cache", "deterministic", "linear", "moe", "norm", "quant", "sampling"]
