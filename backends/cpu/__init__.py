"""The fast CPU backend: C++/OpenMP kernels where they pay, torch's grouped GEMM for the MoE.

Selected by the ``cpu`` platform (``DEEPINFER_CPU_BACKEND``: ``auto`` | ``fast`` | ``reference``) and
checked against the reference backend by the conformance suite like any vendor backend. The op table
is ``deepinfer.backends.cpu.backend.OPS``; importing that module activates the backend (the kernels are
built, or loaded from the cache, by ``deepinfer.backends.cpu.native``), while this package stays
import-light so the platform can ask ``native.toolchain_problem()`` first. What it implements and why:

- ``mla_decode``: reads each cached row once, in place through the block table, with an online softmax,
  split along the KV and merged by log-sum-exp (the reference gathers and pads every request's blocks).
- ``kv_cache_write``, ``rms_norm``, ``add_rms_norm``, ``rope``: one pass each instead of several torch
  ops (at small batches a decode step is mostly op dispatch). ``silu_and_mul`` stays torch's: its
  vectorised SiLU beat a one-pass kernel here.
- ``moe_route``, ``grouped_gemm``, ``fused_moe``: one native pass for routing; the experts' weights read
  in place by a dot-product kernel at small row counts and by MKL over each expert's gathered rows at
  large ones, no argsort, no Python loop over experts and no host synchronisation (``moe``).
"""
