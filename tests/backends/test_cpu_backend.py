"""The fast CPU backend (deepinfer.backends.cpu): conformance, row-wise parity in fp32 and bf16,
platform selection, and greedy agreement end to end (the mutations the suite must catch are in
``test_cpu_mutations``).

Row-wise comparison, like the conformance suite's, at a tighter float32 tolerance.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from deepinfer.backends.cpu import deterministic as fast_deterministic
from deepinfer.backends.cpu import moe as fast_moe
from deepinfer.backends.cpu.backend import OPS as FAST
from deepinfer.backends.registry import load_backend
from deepinfer.backends.testing import checks
from deepinfer.backends.testing.harness import SMALL_MLA, V3_MLA, MLAShape, max_row_error
from tests.conftest import REPO_ROOT

REF = load_backend("deepinfer.backends.reference")
FAST.finalize()
CPU = torch.device("cpu")
ROW_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_rows_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = max_row_error(out, ref)
    assert err < ROW_TOLERANCE[dtype], f"{name}: worst row relative error {err:.2e} ({dtype})"


def test_conformance_suite_passes_for_the_fast_backend(tmp_path: Path) -> None:
    report = tmp_path / "conformance.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "deepinfer.backends.testing",
         f"--junitxml={report}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "DEEPINFER_CONFORMANCE_BACKEND": "deepinfer.backends.cpu.backend",
             "DEEPINFER_CONFORMANCE_DTYPES": "float32,bfloat16,float16", "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("tests", "0")) >= 100 and int(suite.get("skipped", "1")) == 0
    assert int(suite.get("failures", "1")) == 0 and int(suite.get("errors", "1")) == 0


# ----------------------------------------------------------------------------- row-wise parity


def _paged(shape: MLAShape, dtype: torch.dtype, seq_lens: list[int], gen: torch.Generator):
    """A paged cache (unowned blocks NaN) written through the fast kv_cache_write, and its rows."""
    batch = checks.PagedBatch(FAST, CPU, dtype, shape, seq_lens, gen)
    return batch, checks._contiguous_reference_cache(shape, dtype, seq_lens, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape,seq_lens,query_lens,window",
    [
        (SMALL_MLA, [9, 70, 33, 130], [1, 1, 1, 1], None),
        (SMALL_MLA, [9, 70, 33, 130], [1, 3, 2, 4], 24),
        (SMALL_MLA, [3000], [1], None),  # one long request: many KV splits merged by log-sum-exp
        (SMALL_MLA, [3000, 17], [5, 1], 100),
        (V3_MLA, [300, 40], [2, 1], None),
    ],
    ids=["decode", "verify-window", "long", "long-window", "v3"],
)
@pytest.mark.parametrize("formulation", ["default", "deterministic"])
def test_mla_decode_rows(formulation, dtype, shape, seq_lens, query_lens, window) -> None:
    """The default kernel and deterministic mode's batch-invariant one, against the reference."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + len(query_lens))
    batch, (ref_cache, ref_table) = _paged(shape, dtype, seq_lens, gen)
    tokens = sum(query_lens)
    q_nope = torch.randn(tokens, shape.heads, shape.kv_lora_rank, generator=gen) * 0.3
    q_pe = torch.randn(tokens, shape.heads, shape.rope, generator=gen) * 0.3
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (shape.nope + shape.rope) ** -0.5
    kernel = (FAST.default_implementation if formulation == "default" else FAST.deterministic_implementation)(
        "mla_decode"
    )
    out = kernel(q_nope.to(dtype), q_pe.to(dtype), batch.cache, batch.block_table, lens, qsl,
                 max(query_lens), scale, window)  # fmt: skip
    ref = REF.mla_decode(q_nope.to(dtype).float(), q_pe.to(dtype).float(), ref_cache, ref_table, lens, qsl,
                         max(query_lens), scale, window)  # fmt: skip
    assert out.dtype == dtype
    assert_rows_close("mla_decode", out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_ops_rows(dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    x, res = torch.randn(300, 192, generator=gen), torch.randn(300, 192, generator=gen)
    w = 1 + 0.1 * torch.randn(192, generator=gen)
    r = lambda t: t.to(dtype).float()  # noqa: E731  (what the float32 reference sees)
    assert_rows_close(
        "rms_norm", FAST.rms_norm(x.to(dtype), w.to(dtype), 1e-6), REF.rms_norm(r(x), r(w), 1e-6), dtype
    )
    normed, summed = FAST.add_rms_norm(x.to(dtype), res.to(dtype), w.to(dtype), 1e-6)
    ref_normed, ref_summed = REF.add_rms_norm(r(x), r(res), r(w), 1e-6)
    assert_rows_close("add_rms_norm.sum", summed, ref_summed, dtype)
    assert_rows_close("add_rms_norm.norm", normed, ref_normed, dtype)
    gate_up = torch.randn(300, 128, generator=gen)
    assert_rows_close(
        "silu_and_mul", FAST.silu_and_mul(gate_up.to(dtype)), REF.silu_and_mul(r(gate_up)), dtype
    )
    # rope on a strided view, as the model passes the rope part of q
    q = torch.randn(50, 4, 48, generator=gen)[..., 32:]
    k = torch.randn(50, 16, generator=gen)
    positions = torch.randint(0, 4096, (50,), generator=gen)
    table = checks.cos_sin_table(16, 4096)
    for interleaved in (True, False):
        q_out, k_out = FAST.rope(q.to(dtype), k.to(dtype), positions, table, interleaved)
        q_ref, k_ref = REF.rope(r(q), r(k), positions, table, interleaved)
        assert_rows_close("rope.q", q_out, q_ref, dtype)
        assert_rows_close("rope.k", k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [192, 7], ids=["aligned", "odd-width"])
@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_moe_rows(dtype, hidden, tokens) -> None:
    """fused_moe and grouped_gemm against the reference on both of their paths (the dot-product kernel,
    at::mm on an expert's rows) and on the mix the op picks by ``MM_ROWS``."""
    gen = torch.Generator().manual_seed(hidden + tokens)
    experts, inter, top_k = 16, 24, 4
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    weights, ids = checks.random_routing(gen, tokens, experts, top_k)
    ids[: max(1, tokens // 10), 0] = -1  # pairs owned by another rank contribute nothing
    r = lambda t: t.to(dtype).float()  # noqa: E731
    ref = REF.fused_moe(r(x), r(w13), r(w2), weights, ids)
    sizes = torch.randint(0, 2 * tokens // 8 + 2, (experts,), generator=gen)
    sizes[2] = 0
    xs = torch.randn(int(sizes.sum()), hidden, generator=gen)
    ref_gg = REF.grouped_gemm(r(xs), r(w13), sizes)
    args = (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    for mm_rows in (1, fast_moe.MM_ROWS, 1 << 30):  # all at::mm, the float32 threshold, all kernel
        out = torch.ops.deepinfer_cpu.fused_moe(*args, mm_rows)
        assert out.dtype == dtype
        assert_rows_close(f"fused_moe(mm_rows={mm_rows})", out, ref, dtype)
        out = torch.ops.deepinfer_cpu.grouped_gemm(xs.to(dtype), w13.to(dtype), sizes, mm_rows)
        assert_rows_close(f"grouped_gemm(mm_rows={mm_rows})", out, ref_gg, dtype)
    assert torch.equal(
        FAST.fused_moe(*args), torch.ops.deepinfer_cpu.fused_moe(*args, fast_moe.mm_rows(dtype))
    )
    with pytest.raises(ValueError, match="group_sizes sum to"):
        FAST.grouped_gemm(xs[1:].to(dtype), w13.to(dtype), sizes)


def test_moe_ops_with_no_tokens() -> None:
    """An idle data-parallel rank's zero-token forward: empty results of the right shapes."""
    x, w13, w2 = torch.randn(0, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    assert FAST.fused_moe(x, w13, w2, torch.ones(0, 2), torch.zeros(0, 2, dtype=torch.int32)).shape == (0, 8)
    assert FAST.grouped_gemm(x, w13, torch.zeros(4, dtype=torch.long)).shape == (0, 6)
    weights, ids = FAST.moe_route(
        torch.randn(0, 16), torch.zeros(16), 4, 4, 2, "sigmoid", "noaux_tc", True, 2.5
    )
    assert weights.shape == ids.shape == (0, 4) and ids.dtype == torch.int32


def test_moe_ops_name_bad_input() -> None:
    x, w13, w2 = torch.randn(3, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    weights, ids = torch.ones(3, 2), torch.tensor([[0, 1], [2, 3], [3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fused_moe: topk_ids holds expert 4, outside \[0, 4\)"):
        FAST.fused_moe(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="fused_moe: w13 and w2 must have hidden's dtype"):
        FAST.fused_moe(x, w13.double(), w2, weights, ids.clamp(max=3))
    with pytest.raises(ValueError, match="grouped_gemm: group_sizes must be"):
        FAST.grouped_gemm(x, w13, torch.tensor([3]))
    logits = torch.randn(5, 16)
    with pytest.raises(ValueError, match="scoring_func must be 'sigmoid' or 'softmax', got 'tanh'"):
        FAST.moe_route(logits, None, 4, 4, 2, "tanh", "greedy", True, 1.0)
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' needs correction_bias"):
        FAST.moe_route(logits, None, 4, 4, 2, "sigmoid", "noaux_tc", True, 1.0)
    with pytest.raises(ValueError, match=r"n_group \(3\) must divide the 16 experts"):
        FAST.moe_route(logits, torch.zeros(16), 4, 3, 2, "sigmoid", "noaux_tc", True, 1.0)


ROUTINGS = [
    ("sigmoid", "noaux_tc", True),
    ("sigmoid", "noaux_tc", False),
    ("softmax", "greedy", False),
    ("softmax", "group_limited_greedy", True),
]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("experts,top_k,n_group,topk_group", [(16, 4, 4, 2), (256, 8, 8, 4), (64, 6, 1, 1)])
def test_moe_route_ties_resolve_as_the_reference(routing, experts, top_k, n_group, topk_group) -> None:
    """Integer logits and a zero bias tie many scores (and group scores): the experts chosen and their
    order are the reference's (the weights within float32 rounding: torch sums k weights in its own
    order)."""
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randint(-2, 3, (300, experts), generator=gen).float()
    bias = torch.zeros(experts) if routing[1] == "noaux_tc" else None
    args = (logits, bias, top_k, n_group, topk_group, *routing, 2.5)
    weights, ids = FAST.moe_route(*args)
    ref_weights, ref_ids = REF.moe_route(*args)
    assert torch.equal(ids, ref_ids)
    assert_rows_close("moe_route.weights", weights, ref_weights, torch.float32)


def test_kv_cache_write_skips_padding_and_casts() -> None:
    spec = FAST.kv_cache_spec(8, 4, torch.bfloat16)
    (cache,) = spec.allocate(2, CPU)
    cache.fill_(float("nan"))
    kv_c, k_pe = torch.randn(3, 8), torch.randn(3, 4)
    FAST.kv_cache_write(kv_c, k_pe, (cache,), torch.tensor([5, -1, 17]))
    rows = cache.view(-1, 12)
    assert torch.equal(rows[5], torch.cat((kv_c[0], k_pe[0])).to(torch.bfloat16))
    assert torch.equal(rows[17], torch.cat((kv_c[2], k_pe[2])).to(torch.bfloat16))
    assert int(torch.isnan(rows.float()).any(dim=-1).sum()) == 30  # nothing else was written
    with pytest.raises(RuntimeError, match="out of range"):
        FAST.kv_cache_write(kv_c, k_pe, (cache,), torch.tensor([5, 6, 32]))


def test_deterministic_mode_runs_the_fast_backends_own_invariant_formulations() -> None:
    routes = FAST.invariance()
    for name in ("mla_decode", "fused_moe", "grouped_gemm"):
        assert routes[name].formulation == "invariant", routes[name]
    for name in ("rms_norm", "add_rms_norm", "rope", "moe_route", "silu_and_mul", "greedy", "mla_prefill"):
        assert routes[name].formulation == "default", routes[name]
    # one native SwiGLU kernel, invariant as it is, serves both modes (and the invariant grouped experts)
    assert FAST.deterministic_implementation("silu_and_mul") is FAST.default_implementation("silu_and_mul")
    assert fast_deterministic.silu_and_mul is FAST.default_implementation("silu_and_mul")


# ----------------------------------------------------------------------------- platform selection


def test_platform_selects_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer.platform.cpu import cpu_op_backend

    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "fast")
    assert cpu_op_backend() == "deepinfer.backends.cpu.backend"
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "reference")
    assert cpu_op_backend() == "deepinfer.backends.reference"
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "quick")
    with pytest.raises(
        ValueError, match="DEEPINFER_CPU_BACKEND='quick'; choose one of: auto, fast, reference"
    ):
        cpu_op_backend()


def test_without_a_compiler_auto_warns_and_fast_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from deepinfer.platform.cpu import cpu_op_backend
    from deepinfer.platform.interface import PlatformUnavailableError

    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))  # no kernels built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "auto")
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert cpu_op_backend() == "deepinfer.backends.reference"
    assert "no C++ compiler" in caplog.text and "DEEPINFER_CPU_BACKEND=reference" in caplog.text
    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", "fast")
    with pytest.raises(PlatformUnavailableError, match="no C\\+\\+ compiler"):
        cpu_op_backend()


# ----------------------------------------------------------------------------- end to end

PROMPTS = [
    "def fibonacci(n):",
    "import os\nclass Config:",
    "for i in range(10):\n    print(",
    "def quicksort(arr):\n    if len(arr) <= 1:",
]


def _generate(backend: str, monkeypatch: pytest.MonkeyPatch, **options) -> list[list[int]]:
    from deepinfer import LLM, SamplingParams
    from deepinfer.backends.registry import active_ops, set_active_ops
    from deepinfer.platform.registry import set_current_platform

    monkeypatch.setenv("DEEPINFER_CPU_BACKEND", backend)
    set_current_platform(None)
    set_active_ops(None)
    llm = LLM(**options)
    assert active_ops().backend.startswith(
        f"deepinfer.backends.{'cpu' if backend == 'fast' else 'reference'}"
    )
    outs = llm.generate(PROMPTS * 2, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("speculative", [None, "mtp"], ids=["plain", "mtp-verify"])
def test_greedy_tokens_identical_to_the_reference_in_fp32(
    monkeypatch: pytest.MonkeyPatch, speculative
) -> None:
    options = {"dtype": "float32", "speculative": speculative}
    assert _generate("fast", monkeypatch, **options) == _generate("reference", monkeypatch, **options)


def test_bf16_greedy_tokens_stay_close_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 tolerance: over these 8 prompts x 40 tokens, the fast backend's bf16 greedy output keeps on
    average at least 60% of the fp32 reference's tokens before its first divergence, and no less than the
    reference backend's own bf16 run minus 10 points (both round the same weights and cache)."""
    fp32 = _generate("reference", monkeypatch, dtype="float32")

    def kept(seqs: list[list[int]]) -> float:
        prefixes = [
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(seqs, fp32)
        ]
        return sum(prefixes) / (len(prefixes) * 40)

    fast = kept(_generate("fast", monkeypatch, dtype="bfloat16"))
    reference = kept(_generate("reference", monkeypatch, dtype="bfloat16"))
    assert fast >= 0.6 and fast >= reference - 0.1, (fast, reference)


def test_a_build_killed_mid_way_never_blocks_later_starts(tmp_path: Path) -> None:
    """A build killed with SIGKILL leaves torch's ``lock`` baton behind; later starts must not wait on it
    (they used to hang forever). The finished library is loaded directly, and a stale baton is cleared."""
    from deepinfer.backends.cpu import native

    built = native.build_dir() / "deepinfer_cpu_ops.so"
    native.load()  # the library this run already uses (built by ./build.sh or the first activation)
    cache = tmp_path / "cache"
    target = cache / "cpu_ops" / native.build_key()
    target.mkdir(parents=True)
    (target / "deepinfer_cpu_ops.so").write_bytes(built.read_bytes())
    (target / "deepinfer_cpu_ops.so.sha256").write_text(
        (built.parent / "deepinfer_cpu_ops.so.sha256").read_text()
    )
    (target / "lock").write_text("")  # what a killed cpp_extension build leaves
    code = (
        "from deepinfer.backends.cpu import native; ops = native.load(); "
        "print(native.build_dir(), hasattr(ops, 'mla_decode'))"
    )
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(target), "True"]


def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    """A library cut short (a build or copy killed mid-write) beside its recorded digest kills the process
    with SIGBUS when loaded. It must be detected, the directory cleared of the unfinished build, and the
    kernels built again: here torch's builder is replaced by a copy of the finished library, so the test
    does not compile for a minute."""
    from deepinfer.backends.cpu import native

    native.load()
    built = native.build_dir() / "deepinfer_cpu_ops.so"
    target = tmp_path / "cache" / "cpu_ops" / native.build_key()
    target.mkdir(parents=True)
    (target / "deepinfer_cpu_ops.so").write_bytes(built.read_bytes()[:100_000])
    (target / "deepinfer_cpu_ops.so.sha256").write_text(
        (built.parent / "deepinfer_cpu_ops.so.sha256").read_text()
    )
    (target / "kernels.o").write_bytes(b"half an object")
    code = (
        "import shutil, sys; from torch.utils import cpp_extension; from deepinfer.backends.cpu import native\n"
        "def fake_load(name, sources, build_directory, **kwargs):\n"
        "    assert sorted(p.name for p in native.build_dir().iterdir()) == ['build.flock'], 'leftovers kept'\n"
        f"    shutil.copy({str(built)!r}, build_directory)\n"
        "cpp_extension.load = fake_load\n"
        "ops = native.load(); print(hasattr(ops, 'mla_decode'))"
    )
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
    assert "removing an unfinished build" in out.stderr
    assert not (target / "kernels.o").exists()
    assert native._intact(target)
