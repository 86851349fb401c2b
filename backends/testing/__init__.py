"""The backend conformance suite.

Run it against the backend of any platform:

    DEEPINFER_ACCELERATOR=nvidia pytest --pyargs deepinfer.backends.testing --junitxml=report.xml

Every interface op of the active backend is compared with the reference backend (float32, CPU) on
seeded random inputs, at small shapes and at DeepSeek-V3 shapes, with per-dtype tolerances
(relative Frobenius error: float32 < 1e-4, bfloat16/float16 < 2e-2). Environment:
``DEEPINFER_CONFORMANCE_DTYPES`` (default ``float32,bfloat16``) and ``DEEPINFER_CONFORMANCE_FULL=1``
(real V3 hidden/intermediate sizes in the MoE cases; for device runners).
"""
