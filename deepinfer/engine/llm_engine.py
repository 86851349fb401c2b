"""The engine: requests in, one scheduled step at a time, outputs out.

``add_request`` / ``step`` / ``abort_request`` are the streaming interface (the server drives them);
``LLM.generate`` loops over ``step`` for offline use. One step is schedule -> execute -> update:
the scheduler picks tokens to compute, the model runner computes them on the active platform and
samples, and the scheduler and output processor apply the results. The engine never branches on the
platform: the platform names the device and the op backend, and that is all it needs.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer import envs
from deepinfer.backends import ops
from deepinfer.backends.registry import activate, active_ops
from deepinfer.config import WEIGHTS_DTYPES, EngineConfig
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.kv_cache_manager import KVCacheManager
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sched_output import PLACEHOLDER, SchedulerOutput
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.logger import get_logger
from deepinfer.model.loader import load_model
from deepinfer.outputs import RequestOutput
from deepinfer.platform.interface import Platform
from deepinfer.platform.registry import resolve_platform, set_current_platform
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.manager import StructuredOutputs
from deepinfer.text_input import require_valid_text
from deepinfer.tokenizer import Tokenizer
from deepinfer.worker import calibration
from deepinfer.worker.graphs import DecodeGraphs
from deepinfer.worker.inputs import InputBuilder
from deepinfer.worker.memory_profile import profile_shape, profile_step_peak, weight_memory
from deepinfer.worker.model_runner import ModelRunner, RunnerOutput
from deepinfer.worker.spec_decode import ConfidenceHead, MTPProposer

if TYPE_CHECKING:
    from deepinfer.engine.kv_connector import StoreConnector
    from deepinfer.parallel.placement import ExpertShard

logger = get_logger(__name__)

CPU_KV_CACHE_CAP = 4 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(config: EngineConfig, platform: Platform, checkpoint_dtype: str | None) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if config.weights in WEIGHTS_DTYPES:  # --weights bf16 / fp32: the model computes in that dtype
        return DTYPES[WEIGHTS_DTYPES[config.weights]]
    if platform.device_type == "cpu":
        return torch.float32
    return DTYPES.get(checkpoint_dtype or "bfloat16", torch.bfloat16)


class LLMEngine:
    def __init__(self, config: EngineConfig, shard: ExpertShard | None = None) -> None:
        """``shard``: under expert parallelism, the experts this data-parallel rank holds (set by
        ``deepinfer.parallel.rank``, which also owns the process group and the per-step lockstep)."""
        self.config = config
        threads = envs.get("DEEPINFER_NUM_THREADS")
        if threads:
            torch.set_num_threads(threads)
        self.platform = resolve_platform(config.accelerator)
        set_current_platform(self.platform)
        deterministic = (
            config.deterministic if config.deterministic is not None else envs.get("DEEPINFER_DETERMINISTIC")
        )
        self.deterministic = bool(deterministic)
        activate(self.platform, deterministic=self.deterministic)
        self.device = self.platform.device()
        folder = Path(config.model)
        raw_dtype = _checkpoint_dtype(folder)
        self.dtype = _resolve_dtype(config, self.platform, raw_dtype)
        self.model, self.checkpoint = load_model(folder, self.dtype, self.device, shard, config.weights)
        # The startup line's words for the weights, e.g. "weights fp8 128x128 ue8m0 as stored, W8A16".
        self.weights_summary = self.model.weight_plan.describe()
        if self.model.lm_head is not None:  # a tied head is the embedding table: kept row-major
            head = self.model.lm_head.weight
            head.data = self.platform.lm_head_layout(head.data)
        self.weight_memory = weight_memory(self.model)  # as held: FP8 / MXFP4 values and scales as stored
        self.model_config = self.model.config
        tokenizer_dir = Path(config.tokenizer or config.model)
        self.tokenizer = Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() else None
        self.generation_config = _read_json(folder / "generation_config.json")
        self.eos_token_ids = self._eos_ids()

        max_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's maximum of {max_len}")
        self.max_model_len = config.max_model_len or max_len

        c = self.model_config
        self.cache_spec = ops.kv_cache_spec(c.kv_lora_rank, c.qk_rope_head_dim, self.dtype)
        self.num_draft_tokens, self._confidence = self._speculation()
        num_blocks = self._num_kv_blocks()
        self.max_model_len = self._fit_context(num_blocks, self.num_draft_tokens)
        # Graph padding rows read and write one reserved block past the ones the manager hands out.
        self.graph_capture = self._graph_capture(shard)
        cache_blocks = num_blocks + 1 if self.graph_capture else num_blocks
        self.kv_caches = [
            self.cache_spec.allocate(cache_blocks, self.device) for _ in range(self.model.num_cache_layers)
        ]
        if self.graph_capture:
            for layer in self.kv_caches:
                for tensor in layer:
                    tensor[num_blocks].zero_()  # padding rows read the reserved block: keep it finite
        self.kv_cache = KVCacheManager(num_blocks, self.cache_spec.block_size, config.enable_prefix_caching)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        graphs = None
        if self.graph_capture:
            pool = self.platform.graph_pool()  # one pool for every size's graph
            graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                lambda: self.platform.graph(pool),
                self.platform.graph_batch_sizes(config.max_num_seqs),
                -(-self.max_model_len // self.cache_spec.block_size),
                self.cache_spec.block_size,
                num_blocks,
                self.device,
                active_ops().graph_session,
            )
        self.kv_connector = self._kv_store(folder, tokenizer_dir) if config.kv_store is not None else None
        self.runner = self._make_runner(
            self.kv_caches, structured=self.structured, graphs=graphs, kv_connector=self.kv_connector
        )
        self.spec_stats = SpecDecodeStats()
        # The last applied step and its runner seconds (read by the engine core's step log).
        self.last_step: tuple[SchedulerOutput, float] | None = None
        self.cost_model = self._cost_model() if config.step_time_budget_ms else None
        budget = config.max_num_batched_tokens
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold or budget,
                step_time_budget_s=config.step_time_budget_ms / 1e3 if config.step_time_budget_ms else None,
                num_lookahead_tokens=self.num_draft_tokens,
                # the scheduler itself turns them off with drafts or a KV store (Scheduler._decode_steps)
                max_decode_steps=1
                if config.async_scheduling or config.data_parallel_size > 1
                else config.max_decode_steps,
            ),
            self.kv_cache,
            self.cost_model,
            self.kv_connector,
        )
        self.outputs = OutputProcessor(self.tokenizer, config.detokenize)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._children: dict[str, list[str]] = {}
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="deepinfer-step") if config.async_scheduling else None
        )
        self._inflight: tuple[SchedulerOutput, Future[RunnerOutput]] | None = None
        logger.info(
            "engine ready: %s on %s, %s, %s, %d KV blocks of %d tokens (%d layers)",
            folder.name,
            self.platform.describe(),
            str(self.dtype).removeprefix("torch."),
            self.weights_summary,
            num_blocks,
            self.cache_spec.block_size,
            self.model.num_cache_layers,
        )

    # ------------------------------------------------------------------ setup helpers
    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        if gen_eos is not None:
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def _make_runner(
        self,
        kv_caches: list[tuple[torch.Tensor, ...]],
        *,
        structured: StructuredOutputs | None = None,
        graphs: DecodeGraphs | None = None,
        kv_connector: StoreConnector | None = None,
    ) -> ModelRunner:
        """A model runner over ``kv_caches`` (one tuple of cache tensors per cache layer): the engine's
        own, and the memory profile's over a scratch cache."""
        # Deterministic mode: one attention path for every token (prompt chunks take the absorbed decode
        # path too), so a token's attention does not depend on chunking, prefix-cache hits or speculation.
        decode_query_len = (
            self.config.max_num_batched_tokens if self.deterministic else 1 + self.num_draft_tokens
        )
        inputs = InputBuilder(self.cache_spec.block_size, self.device, decode_query_len)
        proposer = (
            MTPProposer(self.model, kv_caches, inputs, self.num_draft_tokens, self._confidence)
            if self.num_draft_tokens
            else None
        )
        return ModelRunner(
            self.model,
            kv_caches,
            inputs,
            self.eos_token_ids,
            self.platform.synchronize,
            structured=structured,
            proposer=proposer,
            graphs=graphs,
            kv_connector=kv_connector,
        )

    def _graph_capture(self, shard: ExpertShard | None) -> bool:
        """``EngineConfig.graph_capture``, or the platform's default when unset; the default is off
        under expert or data parallelism (collectives exchange data-dependent sizes) and in deterministic
        mode (its grouped expert products size their padding from the routing, on the host)."""
        if self.config.graph_capture is not None:
            return self.config.graph_capture
        return (
            shard is None
            and self.config.data_parallel_size == 1
            and not self.deterministic
            and self.platform.graph_capture_default
        )

    def _kv_store(self, folder: Path, tokenizer_dir: Path):
        """The KV store connector (deepinfer/kvstore), passed to the runner."""
        from deepinfer.engine.kv_connector import StoreConnector

        if not self.config.enable_prefix_caching:
            raise ValueError(
                "kv_store needs enable_prefix_caching=True (blocks are named by their prefix hash)"
            )
        c = self.model_config
        connector = StoreConnector(
            self.config.kv_store,
            self.kv_caches,
            self.cache_spec,
            [c.window_of(i) for i in range(c.num_hidden_layers)],
            folder,
            tokenizer_dir,
            self.kv_cache.pool,
            pin_memory=self.platform.device_type != "cpu",
            synchronize=self.platform.synchronize,
        )
        return connector

    def kv_store_stats(self) -> dict | None:
        """The KV store's counters as plain data (``deepinfer.kvstore.metrics``); None when it is off."""
        return self.kv_connector.stats() if self.kv_connector is not None else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush and close the KV store, if any (its queued writes reach their files within
        ``timeout_s``; what cannot is logged). Idempotent; the engine must not step afterwards."""
        if self.kv_connector is not None:
            self.kv_connector.close(timeout_s)

    def _speculation(self) -> tuple[int, tuple[ConfidenceHead, float] | None]:
        """Drafts per request per step (0: speculative decoding off) and, for mtp-confidence, the
        confidence head (on the device) and its threshold."""
        config = self.config
        if config.speculative is None:
            if config.num_draft_tokens is not None or config.confidence_threshold is not None:
                raise ValueError(
                    "num_draft_tokens and confidence_threshold need speculative='mtp' or 'mtp-confidence'"
                )
            return 0, None
        if config.async_scheduling:
            raise ValueError("speculative decoding does not combine with async_scheduling yet; choose one")
        k = max(1, self.model_config.num_nextn_predict_layers)
        confidence = None
        if config.speculative == "mtp-confidence":
            head, threshold = ConfidenceHead.load(Path(config.model))
            k = head.drafts
            confidence = (
                head.to(self.device),
                threshold if config.confidence_threshold is None else config.confidence_threshold,
            )
        return config.num_draft_tokens or k, confidence

    def _cost_model(self) -> StepCostModel:
        """The calibrated step cost model (measured once per platform/chip/model/dtype, then cached),
        or the analytic one from the chip facts."""
        if self.config.cost_model == "chip":
            return StepCostModel.from_chip(self.platform.chip, self.model_config)
        dtype = str(self.dtype).removeprefix("torch.")
        path = calibration.cache_path(
            self.platform.name, self.platform.chip.key, Path(self.config.model), dtype
        )
        if path.is_file():
            return StepCostModel.load(path)
        model = calibration.calibrate(
            self.runner, self.kv_cache.pool, self.config.max_num_batched_tokens, self.max_model_len
        )
        model.save(path)
        return model

    def _num_kv_blocks(self) -> int:
        """``num_kv_blocks``; else the blocks ``kv_cache_memory_gib`` holds; else the blocks 90% of the
        device's free memory holds once one step at the token budget has its peak (profiled; at most
        ``CPU_KV_CACHE_CAP`` on the CPU)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.cache_spec.bytes_per_block() * self.model.num_cache_layers
        if self.config.kv_cache_memory_gib is not None:
            budget = int(self.config.kv_cache_memory_gib * (1 << 30))
            if budget < per_block:
                raise ValueError(
                    f"a KV cache of {budget / 2**30:.3f} GiB holds no block of {per_block} bytes; raise "
                    "kv_cache_memory_gib"
                )
            return budget // per_block
        free, _ = self.platform.mem_get_info()
        peak, shape = self._profile_step()
        budget = int(free * 0.9) - peak
        if self.platform.device_type == "cpu":
            budget = min(budget, CPU_KV_CACHE_CAP)
        if budget < per_block:
            raise ValueError(
                f"no room for a KV cache: {free / 2**30:.2f} GiB of device memory is free (90% usable) and "
                f"one step of max_num_batched_tokens={self.config.max_num_batched_tokens} tokens over "
                f"{len(shape)} requests needs {peak / 2**30:.2f} GiB at its peak; lower "
                "max_num_batched_tokens or max_num_seqs, or set kv_cache_memory_gib / num_kv_blocks"
            )
        logger.info(
            "KV cache sized after a profiled step of %d tokens over %d requests: its peak %.1f MiB, "
            "free memory %.2f GiB (after the weights: %.1f MiB as held) -> %.2f GiB of KV cache",
            sum(shape),
            len(shape),
            peak / 2**20,
            free / 2**30,
            self.weight_memory.total_bytes / 2**20,
            budget / 2**30,
        )
        return budget // per_block

    def _profile_step(self) -> tuple[int, list[int]]:
        """The peak bytes of the largest step the scheduler can make, and its prompt lengths."""
        max_len = self.max_model_len - self.num_draft_tokens
        shape = profile_shape(self.config.max_num_batched_tokens, self.config.max_num_seqs, max_len)
        peak = profile_step_peak(
            self._make_runner,
            self.cache_spec,
            self.model.num_cache_layers,
            self.device,
            self.model_config.vocab_size,
            shape,
            self.num_draft_tokens,
            self.platform.peak_memory_of,
        )
        return peak, shape

    def _fit_context(self, num_blocks: int, lookahead: int) -> int:
        """The context length one request may use: ``max_model_len`` when the whole KV cache can hold a
        request that long (with its draft slots), else a startup error naming both numbers; without
        an explicit ``max_model_len``, the model's maximum is lowered to what the cache holds (logged)."""
        bs = self.cache_spec.block_size
        capacity = num_blocks * bs - lookahead
        if self.max_model_len <= capacity:
            return self.max_model_len
        holds = f"{num_blocks} KV blocks of {bs} tokens hold {num_blocks * bs} tokens" + (
            f" ({lookahead} per request kept for drafts)" if lookahead else ""
        )
        if self.config.max_model_len is not None:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the KV cache can hold: {holds}, so one "
                f"request fits at most {capacity} tokens; lower max_model_len or raise num_kv_blocks / "
                "kv_cache_memory_gib"
            )
        if capacity < 2:
            raise ValueError(f"the KV cache is too small for any request: {holds}; raise num_kv_blocks")
        logger.warning(
            "context length lowered from the model's %d to %d tokens: %s", self.max_model_len, capacity, holds
        )
        return capacity

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
    ) -> None:
        """Queue a request. Give ``prompt`` (text, tokenized here), ``prompt_token_ids``, or both
        (the ids are used; the text is echoed back in outputs). Bad input raises ValueError naming
        what is wrong; whatever it raises, nothing of the request stays behind (no matcher, output
        state or queued child), so the engine goes on serving the others."""
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._children or any(c in self.outputs.parent_of for c in child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(require_valid_text(prompt, "prompt"))
        prompt_token_ids = list(prompt_token_ids)
        self._validate_prompt(prompt_token_ids)
        if self.kv_connector is not None:
            self.kv_connector.check_class(params.traffic_class)
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_token_ids)} tokens exceeds the "
                f"context length {self.max_model_len}; at most {room} new tokens fit"
            )
        max_tokens = params.max_tokens or room
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        children = [
            Request(
                request_id=child_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=params,
                seed=base_seed if i == 0 else (base_seed * 1_000_003 + i) % (1 << 63),
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=time.monotonic(),
            )
            for i, child_id in enumerate(child_ids)
        ]
        try:
            for child in children:
                self.structured.add(child.request_id, params)
            self.outputs.add(request_id, prompt, children)
            for child in children:
                self.scheduler.add_request(child)
        except BaseException:
            self._discard(request_id, children)
            raise
        self._children[request_id] = child_ids

    def _discard(self, request_id: str, children: list[Request]) -> None:
        """Undo a partly added request: its matchers, output state and queued children."""
        for child in children:
            self.structured.remove(child.request_id)
            if self.scheduler.requests.get(child.request_id) is child:
                self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_ABORTED)
        self.outputs.discard(request_id)

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.max_model_len}, so at most "
                f"{self.max_model_len - 1} prompt tokens fit"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their KV blocks. Unknown or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for child_id in self._children.pop(rid, []):
                request = self.scheduler.requests.get(child_id)
                self.structured.remove(child_id)
                if request is not None:
                    self.scheduler.finish_requests([child_id], RequestStatus.FINISHED_ABORTED)
                    self.outputs.finish(request)
            if rid in self.outputs.states:
                self.outputs.output(rid)  # releases the state: every completion has now ended

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the (cumulative) outputs of every request that progressed."""
        if self.config.async_scheduling:
            return self._step_async()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.kv_connector is not None:
                self.kv_connector.idle_wait()  # nothing runs: wait a moment for a KV-store load
            return []
        return self.run_scheduled(scheduled)

    def run_scheduled(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Execute a non-empty scheduled step and apply its results (what ``step`` does after
        scheduling; the data-parallel lockstep schedules, agrees with the other ranks, then calls this)."""
        return self._apply(scheduled, self._execute(scheduled))

    def _step_async(self) -> list[RequestOutput]:
        """Asynchronous scheduling: step N+1 is scheduled while step N computes on the device.

        Step N+1 is planned with placeholders for the tokens step N is sampling; once N's results are
        applied, the placeholders are filled in and requests that finished meanwhile are dropped, and
        N+1 starts. Outputs are those of the synchronous loop, one step later.
        """
        if self._inflight is None:
            scheduled = self.scheduler.schedule()
            if scheduled.is_empty:
                return []
            self._inflight = (scheduled, self._executor.submit(self._execute, scheduled))
        scheduled, future = self._inflight
        ahead = self.scheduler.schedule()
        outputs = self._apply(scheduled, future.result())
        ahead = self._resolve_placeholders(ahead)
        self._inflight = None if ahead.is_empty else (ahead, self._executor.submit(self._execute, ahead))
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        result = self.runner.execute(scheduled)
        result.seconds = time.perf_counter() - start
        return result

    def _resolve_placeholders(self, ahead: SchedulerOutput) -> SchedulerOutput:
        kept = []
        for r in ahead.requests:
            request = self.scheduler.requests.get(r.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (or preempted) after it was scheduled ahead
            for i, token in enumerate(r.token_ids):
                if token == PLACEHOLDER:
                    r.token_ids[i] = request.all_token_ids[r.num_computed_tokens + i]
            kept.append(r)
        ahead.requests = kept
        return ahead

    def _apply(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        for rid, entries in result.prompt_logprobs.items():
            if rid in self.scheduler.requests:  # not aborted while the step ran (async scheduling)
                self.outputs.record_prompt_logprobs(rid, entries)
        self.last_step = (scheduled, result.seconds)
        self.scheduler.observe_step_time(scheduled, result.seconds)
        updated = self.scheduler.update_from_output(scheduled, result.sampled, result.drafts)
        self.spec_stats.record(result)
        parents = []
        for request in updated:
            self.structured.accept(request.request_id, result.sampled[request.request_id])
            stop = self.outputs.record_tokens(request, result.logprobs.get(request.request_id))
            if stop is not None and not request.status.finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED, stop)
            if request.status.finished:
                self.outputs.finish(request)
                self.structured.remove(request.request_id)
            parent = self.outputs.parent_of[request.request_id]
            if parent not in parents:
                parents.append(parent)
        outputs = [self.outputs.output(p) for p in parents]
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return outputs


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _checkpoint_dtype(folder: Path) -> str | None:
    raw = _read_json(folder / "config.json")
    return raw.get("torch_dtype") or raw.get("dtype")
