"""deepinfer.backends: the op interface (``ops``), the op registry, the reference backend and the
conformance suite (``deepinfer.backends.testing``). Imports torch only; vendor libraries are imported
by their own backends (``deepinfer.ops_cuda``, ``deepinfer.ops_ascend``) when activated."""
