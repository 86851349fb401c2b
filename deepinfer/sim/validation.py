"""Check the simulator against our own engine: one trace, replayed through ``deepinfer serve`` on this
machine and through the simulator calibrated on this machine.

The trace: Poisson arrivals of code prompts (held-out stdlib code, tokenized by the model's own
tokenizer) that share prefixes — each prompt is one of a few shared file headers followed by its own
window of code — with a fixed output length (EOS ignored). The real side streams each request over
HTTP (``deepinfer.bench.serve``) from a server running one aggregated worker with a step time
budget. The simulated side runs the engine's scheduler with the server's settings, with the step
cost model the server calibrated at start-up — a fresh server per trace, so that its profiling sweep
runs right before the trace it models, under the same host load — corrected by two figures fitted
on a *different* trace
(the calibration run: other prompts and arrival times, same rate): a factor on step time (the real
step on a 2-core host also pays for the HTTP front, detokenization and the load generator sharing
the cores, which the start-up calibration of forward passes alone does not see) and the front's
admission delay. The engine's busy time during each trace (``GET /load``) is reported beside the
simulated one: on a shared host, a gap between them that the calibration trace did not have is the
load having changed between the sweep and the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.sim.cluster import ClusterConfig, EngineKnobs, PoolConfig, Simulation
from deepinfer.sim.costs import CalibratedCost
from deepinfer.sim.report import summarise
from deepinfer.sim.workload import Arrival, Segment

METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))


@dataclass(frozen=True, slots=True)
class TraceSpec:
    num_requests: int = 100
    request_rate: float = 3.0
    output_len: int = 96
    shared_prefixes: int = 6
    prefix_len: int = 384
    suffix_len: tuple[int, int] = (32, 512)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    step_time_budget_ms: float = 100.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_cache_memory_gib: float = 1.0

    def args(self) -> list[str]:
        return [
            "--step-time-budget-ms", str(self.step_time_budget_ms),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-num-seqs", str(self.max_num_seqs),
            "--kv-cache-memory-gib", str(self.kv_cache_memory_gib),
        ]  # fmt: skip


def build_prompts(stream: list[int], spec: TraceSpec) -> list[list[int]]:
    """Prompts of ``spec``: a shared prefix (Zipf-popular) + the request's own code window."""
    rng = random.Random(f"prompts/{spec.seed}")
    lo, hi = spec.suffix_len
    starts = [rng.randrange(len(stream) - spec.prefix_len) for _ in range(spec.shared_prefixes)]
    prefixes = [stream[s : s + spec.prefix_len] for s in starts]
    weights = [1 / (k + 1) for k in range(spec.shared_prefixes)]
    prompts = []
    for _ in range(spec.num_requests):
        prefix = rng.choices(prefixes, weights)[0]
        n = rng.randint(lo, hi)
        s = rng.randrange(len(stream) - n)
        prompts.append(prefix + stream[s : s + n])
    return prompts


def arrival_times(spec: TraceSpec) -> list[float]:
    """The send times ``deepinfer.bench.serve.run_load`` uses for ``seed`` (exponential gaps)."""
    rng = random.Random(spec.seed)
    times, t = [], 0.0
    for _ in range(spec.num_requests):
        times.append(t)
        t += rng.expovariate(spec.request_rate)
    return times


def simulate_trace(
    prompts: list[list[int]], spec: TraceSpec, settings: ServerSettings, model: StepCostModel, num_blocks: int,
    block_size: int, scale: float = 1.0, admission_delay_s: float = 0.0,
) -> dict:  # fmt: skip
    """The simulator's figures for the trace, in the load generator's terms."""
    arrivals = [
        Arrival(t, f"r{i}", "code", (Segment(("prompt", i), len(p)),), spec.output_len, tuple(p))
        for i, (t, p) in enumerate(zip(arrival_times(spec), prompts))
    ]
    knobs = EngineKnobs(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        step_time_budget_s=settings.step_time_budget_ms / 1e3, max_model_len=1 << 20,
    )  # fmt: skip
    pool = PoolConfig("both", 1, 1, CalibratedCost(model, scale), knobs)
    sim = Simulation(ClusterConfig([pool], admission_delay_s=admission_delay_s))
    sim.run(arrivals, until=1e6)
    result = summarise(sim, 0.0, arrivals[-1].time + 1e-9, 1)
    finished = [t.finished_s for t in sim.traces.values()]
    result["wall_s"] = max(finished)
    result["output_tokens_per_s"] = len(arrivals) * spec.output_len / result["wall_s"]
    result["prefix_cache_hit_rate"] = result["cache_hit_rate"].get("device", 0.0)
    result["busy_s"] = sim.pools["both"][0].busy_s
    return result


def errors(real: dict, simulated: dict) -> dict[str, float]:
    out = {f"{m.removesuffix('_s')}_{q}": simulated[m][q] / real[m][q] - 1 for m, q in METRICS}
    out["throughput"] = simulated["output_tokens_per_s"] / real["output_tokens_per_s"] - 1
    return out


def fit_overheads(
    prompts: list[list[int]], spec: TraceSpec, settings: ServerSettings, model: StepCostModel, num_blocks: int,
    block_size: int, real: dict,
) -> tuple[float, float]:  # fmt: skip
    """What the start-up calibration does not see, fitted on the calibration run: a factor on step
    time (golden-section search on the TPOT p50 error), then the API front's admission delay (the
    TTFT p50 left over, which a constant delay shifts one for one)."""

    def tpot_error(scale: float) -> float:
        return abs(
            errors(real, simulate_trace(prompts, spec, settings, model, num_blocks, block_size, scale))[
                "tpot_p50"
            ]
        )

    lo, hi = 0.5, 3.0
    golden = 0.618
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    fa, fb = tpot_error(a), tpot_error(b)
    for _ in range(10):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - golden * (hi - lo)
            fa = tpot_error(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (hi - lo)
            fb = tpot_error(b)
    scale = (a + b) / 2
    simulated = simulate_trace(prompts, spec, settings, model, num_blocks, block_size, scale)
    delay = max(0.0, real["ttft_s"]["p50"] - simulated["ttft_s"]["p50"])
    return scale, delay


def run_trace(
    model_dir: str, spec: TraceSpec, settings: ServerSettings, stream: list[int], cache_dir: Path
) -> dict:
    """One trace through a fresh ``deepinfer serve`` whose start-up calibration (a profiling sweep of
    step shapes in that process) runs right before the trace, in the same conditions. Returns the
    prompts, the measured figures, that server's cost model, the engine's busy seconds during the
    trace (``GET /load``) and the host's load average before and after. ``cache_dir`` is the
    server's cache folder: its stored cost models are removed first (so that the server calibrates),
    its compiled kernels kept."""
    import httpx

    from deepinfer.bench.serve import launch, run_load
    from deepinfer.worker import calibration as engine_calibration

    prompts = build_prompts(stream, spec)
    shutil.rmtree(cache_dir / "cost_models", ignore_errors=True)
    # One engine thread: steadier on a shared host.
    server_env = {"DEEPINFER_CACHE_DIR": str(cache_dir), "DEEPINFER_NUM_THREADS": "1"}
    with _environ(server_env):
        load_before = os.getloadavg()
        with launch(model_dir, settings.args()) as url:
            before = httpx.get(f"{url}/metrics").text
            busy_before = httpx.get(f"{url}/load").json()["engine"]["busy_s"]
            real = asyncio.run(
                run_load(
                    url,
                    Path(model_dir).name,
                    prompts,
                    spec.output_len,
                    spec.request_rate,
                    600.0,
                    spec.seed,
                )
            )
            busy = httpx.get(f"{url}/load").json()["engine"]["busy_s"] - busy_before
            after = httpx.get(f"{url}/metrics").text
        path = engine_calibration.cache_path("cpu", "cpu", Path(model_dir), "float32")
        if not path.is_file():
            raise RuntimeError(f"the server left no calibrated cost model at {path}")
        model = StepCostModel.load(path)
    queries, hits = (b - a for a, b in zip(_prefix_counters(before), _prefix_counters(after)))
    real["prefix_cache_hit_rate"] = hits / max(1, queries)
    return {"prompts": prompts, "real": real, "model": model, "busy_s": busy,
            "load_average": (load_before, os.getloadavg())}  # fmt: skip


def run_validation(
    model_dir: str, calibration: TraceSpec, validation: TraceSpec, settings: ServerSettings
) -> dict:
    """Two traces (their prompts share no prefixes), each through a freshly calibrated server; the
    overheads fitted on the first, the check on the second (with its own server's calibration).
    Returns the measured and simulated figures, the relative errors, and per trace the engine's
    measured busy time against the simulated one (a shift there is the host's load changing)."""
    from deepinfer.backends.reference.cache import BLOCK_SIZE
    from deepinfer.bench.workload import heldout_stream
    from deepinfer.tokenizer import Tokenizer

    stream = heldout_stream(Tokenizer(Path(model_dir)))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)  # MTP layers cache too
    bytes_per_block = BLOCK_SIZE * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4 * layers
    num_blocks = int(settings.kv_cache_memory_gib * (1 << 30)) // bytes_per_block
    cache_dir = Path(tempfile.mkdtemp(prefix="deepinfer-simval-"))
    try:
        runs = {name: (spec, run_trace(model_dir, spec, settings, stream, cache_dir))
                for name, spec in (("calibration", calibration), ("validation", validation))}  # fmt: skip
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    spec, cal = runs["calibration"]
    scale, delay = fit_overheads(
        cal["prompts"], spec, settings, cal["model"], num_blocks, BLOCK_SIZE, cal["real"]
    )
    out = {"settings": settings.args(), "server_env": {"DEEPINFER_NUM_THREADS": "1"}, "scale": scale,
           "admission_delay_s": delay, "num_blocks": num_blocks}  # fmt: skip
    for name, (spec, run) in runs.items():
        simulated = simulate_trace(
            run["prompts"], spec, settings, run["model"], num_blocks, BLOCK_SIZE, scale, delay
        )
        out[name] = {
            "trace": asdict(spec),
            "cost_model": asdict(run["model"]),
            "load_average_before_after": run["load_average"],
            "engine_busy_s": {"measured": run["busy_s"], "simulated": simulated["busy_s"]},
            "measured": _figures(run["real"]),
            "simulated": _figures(simulated),
            "errors": errors(run["real"], simulated),
        }
    return out


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for a child process started inside, and restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _figures(result: dict) -> dict:
    figures = {f"{m.removesuffix('_s')}_{q}": result[m][q] for m, q in METRICS}
    figures["output_tokens_per_s"] = result["output_tokens_per_s"]
    figures["prefix_cache_hit_rate"] = result["prefix_cache_hit_rate"]
    return figures


def _prefix_counters(metrics_text: str) -> tuple[float, float]:
    values = {}
    for line in metrics_text.splitlines():
        for name in ("deepinfer_prefix_cache_queries_total", "deepinfer_prefix_cache_hits_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values.get("deepinfer_prefix_cache_queries_total", 0.0), values.get(
        "deepinfer_prefix_cache_hits_total", 0.0
    )
