"""The fast CPU backend: C++/OpenMP kernels where they pay.

Selected by the ``cpu`` platform (``DEEPINFER_CPU_BACKEND``: ``auto`` | ``fast`` | ``reference``) and
checked against the reference backend by the conformance suite like any vendor backend. The op table
is ``deepinfer.backends.cpu.backend.OPS``; importing that module activates the backend (the kernels are
built, or loaded from the cache, by ``deepinfer.backends.cpu.native``), while this package stays
import-light so the platform can ask ``native.toolchain_problem()`` first. What it implements and why:

- ``mla_decode``: reads each cached row once, in place through the block table (the next tile's rows
  prefetched), with an online softmax over tiles of 16 keys; a work item is a block of a request's
  (token, head) rows against a range of its keys, and a request's keys are split into ranges merged by
  log-sum-exp only when the batch alone cannot keep the threads busy (the reference gathers and pads
  every request's blocks). Deterministic mode's invariant kernel runs the same work items unsplit.
- ``kv_cache_write``, ``rms_norm``, ``add_rms_norm``, ``rope``, ``silu_and_mul``: one pass each
  instead of several torch ops (at small batches a decode step is mostly op dispatch; a prefill chunk's
  SwiGLU is three passes over memory in torch).
- ``linear``: up to eight rows, skinny products (``csrc/skinny.h``) that read the weight in place in
  either layout (nn.Linear's rows, or a transposed view: the D-major LM head, MLA's absorbed W_UK) with
  enough independent accumulators to stream it at memory speed, split over threads by output columns;
  more rows, MKL (``at::linear``; one ``bmm`` on strided views for the per-head form).
- ``moe_route``, ``grouped_gemm``, ``fused_moe``: one native pass for routing; an expert with few rows
  runs the same skinny products on its gathered rows, work items (expert, block of output columns), and
  one with many goes to MKL over its gathered rows; no argsort, no Python loop over experts and no host
  synchronisation (``moe``).
- ``greedy``: a row's argmax by a vector scan (torch's compares one element at a time).
- ``fp8_linear``, ``fp8_linear_w8a8``, ``grouped_gemm_quant``, ``fused_moe_quant``: FP8 / MXFP4 weights
  kept as stored and decoded per vector in registers, the instruction set chosen at run time
  (``quant``).

Decode steps run as CPU graphs (``graph``): the step's op calls recorded once per batch size and
replayed from C++ without Python (``deepinfer.platform.cpu``'s graph wrapper).
"""
