"""Check the simulator against our own engine: one trace, replayed through ``deepinfer serve`` on this
machine and through the simulator calibrated on this machine.

The trace: Poisson arrivals of code prompts (held-out stdlib code, tokenized by the model's own
tokenizer) that share prefixes — each prompt is one of a few shared file headers followed by its own
window of code — with a fixed output length (EOS ignored). The real side streams each request over
HTTP (``deepinfer.bench.serve``) from a server running one aggregated worker with a step time
budget. The simulated side runs the engine's scheduler with the server's settings, with the step
cost model the server calibrated at start-up, corrected by two figures fitted on a *different* trace
(the calibration run: other prompts and arrival times, same rate): a factor on step time (the real
step on a 2-core host also pays for the HTTP front, detokenization and the load generator sharing
the cores, which the start-up calibration of forward passes alone does not see) and the front's
admission delay.
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


def run_validation(
    model_dir: str, calibration: TraceSpec, validation: TraceSpec, settings: ServerSettings
) -> dict:
    """Both runs on one server (their prompts share no prefixes), the fit on the first, the check on
    the second. Returns the measured and simulated figures and the relative errors."""
    import httpx

    from deepinfer.backends.reference.cache import BLOCK_SIZE
    from deepinfer.bench.serve import launch, run_load
    from deepinfer.bench.workload import heldout_stream
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.worker import calibration as engine_calibration

    stream = heldout_stream(Tokenizer(Path(model_dir)))
    load_before = os.getloadavg()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)  # MTP layers cache too
    bytes_per_block = BLOCK_SIZE * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4 * layers
    num_blocks = int(settings.kv_cache_memory_gib * (1 << 30)) // bytes_per_block
    runs = {}
    cache_dir = tempfile.mkdtemp(prefix="deepinfer-simval-")
    # The server calibrates its cost model at start-up, right before the traces (one thread: steadier
    # on a shared host); the cache folder is fresh so that the calibration is today's, not a stored one.
    server_env = {"DEEPINFER_CACHE_DIR": cache_dir, "DEEPINFER_NUM_THREADS": "1"}
    with _environ(server_env), launch(model_dir, settings.args()) as url:
        for name, spec in (("calibration", calibration), ("validation", validation)):
            prompts = build_prompts(stream, spec)
            before = _prefix_counters(httpx.get(f"{url}/metrics").text)
            real = asyncio.run(
                run_load(
                    url, Path(model_dir).name, prompts, spec.output_len, spec.request_rate, 600.0, spec.seed
                )
            )
            after = _prefix_counters(httpx.get(f"{url}/metrics").text)
            real["prefix_cache_hit_rate"] = (after[1] - before[1]) / max(1, after[0] - before[0])
            runs[name] = (spec, prompts, real)
    with _environ(server_env):
        path = engine_calibration.cache_path("cpu", "cpu", Path(model_dir), "float32")
    if not path.is_file():
        raise RuntimeError(f"the server left no calibrated cost model at {path}")
    model = StepCostModel.load(path)
    shutil.rmtree(cache_dir)
    spec, prompts, real = runs["calibration"]
    scale, delay = fit_overheads(prompts, spec, settings, model, num_blocks, BLOCK_SIZE, real)
    out = {"settings": settings.args(), "server_env": {"DEEPINFER_NUM_THREADS": "1"}, "cost_model": asdict(model),
           "scale": scale, "admission_delay_s": delay, "num_blocks": num_blocks, "load_average_before": load_before,
           "load_average_after": os.getloadavg()}  # fmt: skip
    for name, (spec, prompts, real) in runs.items():
        simulated = simulate_trace(prompts, spec, settings, model, num_blocks, BLOCK_SIZE, scale, delay)
        out[name] = {
            "trace": asdict(spec),
            "measured": _figures(real),
            "simulated": _figures(simulated),
            "errors": errors(real, simulated),
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
