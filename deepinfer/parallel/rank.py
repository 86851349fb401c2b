"""One data-parallel rank: an LLMEngine whose model is expert-parallel over a torch.distributed group,
stepped in lockstep with the other ranks.

Who creates it: the process that hosts a rank (the offline front's rank processes in
``deepinfer.parallel.front``, or an engine-core server process), once per rank, after which it calls
``step`` in a loop and ``add_request`` / ``abort_request`` between steps. Everything it exchanges with
its host is host data (``RequestOutput``, ``RankLoad``).

The lockstep protocol, one iteration of ``step`` on every rank:

1. schedule locally (this rank's scheduler and KV cache);
2. all-reduce a header ``[tokens scheduled, unfinished requests, stop wanted]`` over the group;
3. if no rank scheduled a token, nothing runs (``RankStep.any_work`` says whether a rank still has
   requests; a host with nothing to do waits a little before its next ``step``); otherwise a rank with
   tokens runs its step and a rank without runs a zero-token forward, so every MoE layer's
   ``ep_dispatch``/``ep_combine`` is issued by every rank in the same order;
4. with ``DEEPINFER_DP_CHECK_COLLECTIVES`` set, the ranks all-gather a digest of the collectives each
   issued and fail, naming the ranks, when they differ;
5. every ``eplb_interval`` computing steps (the same step on every rank, since the header is shared),
   the window's expert load is all-reduced and a rearrangement is planned and maybe applied;
6. when any rank asked to stop, every rank returns ``stop=True`` after the same iteration.

A rank that dies or hangs makes the others' next collective fail after at most ``dp_timeout_s``
(the process-group timeout); the error propagates out of ``step``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.logger import get_logger
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader import Checkpoint
from deepinfer.model.moe import MoE
from deepinfer.outputs import RequestOutput
from deepinfer.parallel import rearrange
from deepinfer.parallel.expert_load import ExpertLoadRecorder
from deepinfer.parallel.placement import ExpertShard, check_expert_parallel, expert_weight_bytes
from deepinfer.platform.registry import resolve_platform
from deepinfer.sampling_params import SamplingParams

logger = get_logger(__name__)


class CollectiveMismatchError(RuntimeError):
    """The ranks issued different collective sequences in one step (a lockstep bug)."""


@dataclass(slots=True)
class RankLoad:
    """What the front balances by, and what the tests check at the end (every block free)."""

    rank: int
    num_running: int
    num_waiting: int
    kv_usage: float  # share of KV blocks referenced by requests
    free_blocks: int
    total_blocks: int
    expert_weight_bytes: int


@dataclass(slots=True)
class RankStep:
    outputs: list[RequestOutput]
    tokens: int  # tokens all ranks computed this iteration
    any_work: bool  # some rank still has unfinished requests
    stop: bool  # the ranks agreed to stop: the host leaves its loop
    rearranged: rearrange.Decision | None = None
    received_pairs: int = 0  # (token, expert) pairs this rank's experts computed this iteration


@dataclass(slots=True)
class RankStats:
    """Per computing step: pairs this rank's experts computed, its wall time and the tokens all ranks
    computed; the EPLB decisions taken (step, balance before, after, bytes, applied); requests added."""

    received: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    decisions: list[tuple[int, float, float, int, bool]] = field(default_factory=list)
    requests_added: int = 0
    idle_steps: int = 0  # zero-token forwards this rank ran while others computed


def init_group(config: EngineConfig, rank: int, init_method: str) -> None:
    """Join the data-parallel group (the platform's collective backend: gloo, nccl or hccl)."""
    backend = resolve_platform(config.accelerator).dist_backend
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=config.data_parallel_size,
        timeout=timedelta(seconds=config.dp_timeout_s),
    )


def check_collective_sequence(
    trace: list[str], group: Any, rank: int, step: int, device: torch.device | str = "cpu"
) -> None:
    """Debug mode: all-gather a digest of the collectives this rank issued in ``step`` and raise
    CollectiveMismatchError, naming the ranks that differ, unless every rank issued the same. Collective."""
    sequence = "|".join(trace)
    digest = int.from_bytes(hashlib.blake2b(sequence.encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    digests = [int(t) for t in gathered]
    if len(set(digests)) > 1:
        differing = [r for r, d in enumerate(digests) if d != digests[rank]]
        raise CollectiveMismatchError(
            f"rank {rank}: ranks {differing} issued a different collective sequence in step {step}; "
            f"this rank issued {len(trace)}: {sequence[:300]}"
        )


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The engine config of data-parallel rank ``rank``: with more than one rank, its KV store's disk
    tier is its own subfolder ``PATH/rank-N`` (one owner per disk tier directory, ``kvstore.owner``)
    with an even share of ``capacity_gib``; the shared tier stays one directory for all (it is
    multi-writer by design, one file per block)."""
    store = config.kv_store
    if config.data_parallel_size == 1 or store is None or store.path is None:
        return config
    own = store.model_copy(
        update={
            "path": str(Path(store.path) / f"rank-{rank}"),
            "capacity_gib": store.capacity_gib / config.data_parallel_size,
        }
    )
    return config.model_copy(update={"kv_store": own})


class DataParallelRank:
    """Owns one rank's LLMEngine and its lockstep (see the module docstring). The process group must
    be initialised (``init_group``) before construction; ``close`` leaves it."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.group = dist.group.WORLD
        model_config = ModelConfig.from_dict(Checkpoint.open(config.model).raw_config)
        check_expert_parallel(model_config, config)
        self.shard = (
            ExpertShard.initial(model_config, config, rank, self.group)
            if config.enable_expert_parallel
            else None
        )
        self.engine = LLMEngine(rank_config(config, rank), self.shard)
        self.moes = {m.layer: m for m in self.engine.model.modules() if isinstance(m, MoE)}
        self.trace: list[str] | None = [] if envs.get("DEEPINFER_DP_CHECK_COLLECTIVES") else None
        self.recorder: ExpertLoadRecorder | None = None
        if self.shard is not None:
            self.recorder = ExpertLoadRecorder(self.shard.layers, self.shard.num_experts, config.eplb_window)
            for moe in self.moes.values():
                moe.load_recorder, moe.trace = self.recorder, self.trace
        self._device = self.engine.device if dist.get_backend(self.group) != "gloo" else torch.device("cpu")
        self._stop_wanted = False
        self._live: set[str] = set()  # request ids added and not finished
        self.computing_steps = 0
        self.stats = RankStats()

    # ------------------------------------------------------------------ requests (between steps)
    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> None:
        self.engine.add_request(request_id, prompt, prompt_token_ids, params)
        self._live.add(request_id)
        self.stats.requests_added += 1

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        self.engine.abort_request(ids)
        self._live.difference_update(ids)

    def request_stop(self) -> None:
        """Ask every rank to stop after the next iteration (this rank's unfinished requests are aborted)."""
        self._stop_wanted = True

    def load(self) -> RankLoad:
        sched, kv = self.engine.scheduler, self.engine.kv_cache
        return RankLoad(
            self.rank,
            len(sched.running),
            len(sched.waiting),
            kv.usage(),
            kv.num_free_blocks,
            kv.pool.num_blocks,
            expert_weight_bytes(self.engine.model),
        )

    # ------------------------------------------------------------------ the lockstep
    def step(self) -> RankStep:
        """One lockstep iteration (collective: every rank of the group calls it)."""
        engine = self.engine
        scheduled = engine.scheduler.schedule()
        header = torch.tensor(
            [scheduled.num_tokens, int(engine.has_unfinished_requests()), int(self._stop_wanted)],
            dtype=torch.int64,
            device=self._device,
        )
        dist.all_reduce(header, group=self.group)
        tokens, unfinished, stop = header.tolist()
        if stop:  # scheduled work is dropped with its requests
            engine.abort_request(sorted(self._live))
            self._live.clear()
            return RankStep([], 0, False, True)
        if tokens == 0:
            return RankStep([], 0, bool(unfinished), False)
        if self.trace is not None:
            self.trace.clear()
        start = time.perf_counter()
        if scheduled.is_empty:
            with torch.inference_mode():
                engine.model.idle_forward()
            self.stats.idle_steps += 1
            outputs: list[RequestOutput] = []
        else:
            outputs = engine.run_scheduled(scheduled)
            self._live.difference_update(o.request_id for o in outputs if o.finished)
        seconds = time.perf_counter() - start
        if self.trace is not None:
            self._check_collectives()
        result = RankStep(outputs, tokens, True, False)
        self.computing_steps += 1
        if self.recorder is not None:
            self.recorder.advance()
            result.received_pairs = self.recorder.last_received()
            self.stats.received.append(result.received_pairs)
        self.stats.step_seconds.append(seconds)
        self.stats.tokens.append(tokens)
        interval = self.config.eplb_interval
        if interval and self.computing_steps % interval == 0:
            result.rearranged = self._rearrange()
        return result

    def _check_collectives(self) -> None:
        check_collective_sequence(self.trace or [], self.group, self.rank, self.computing_steps, self._device)

    def _rearrange(self) -> rearrange.Decision:
        """All-reduce the window's load, plan, and (when it pays) move the experts. Collective."""
        assert self.shard is not None and self.recorder is not None
        load = self.recorder.window_load().to(self._device)
        dist.all_reduce(load, group=self.group)
        any_moe = next(iter(self.moes.values()))
        bytes_per_slot = any_moe.experts.slot_bytes()  # values plus scales, as held
        decision = rearrange.plan(
            load.cpu(),
            self.shard,
            self.engine.model_config.n_group,
            self.config.nnodes,
            bytes_per_slot,
            self.config.eplb_min_gain,
            self.config.eplb_gain_per_gib,
        )
        if decision.apply:
            rearrange.apply(self.moes, self.shard, decision.phy2log)
        self.stats.decisions.append(
            (
                self.computing_steps,
                decision.balance_before,
                decision.balance_after,
                decision.bytes_moved,
                decision.apply,
            )
        )
        logger.info(
            "rank %d EPLB at step %d: predicted balance %.3f -> %.3f, %d bytes to move: %s",
            self.rank,
            self.computing_steps,
            decision.balance_before,
            decision.balance_after,
            decision.bytes_moved,
            "applied" if decision.apply else "kept",
        )
        return decision

    def close(self) -> None:
        """Close this rank's engine (its KV store writes its backlog and stats record and releases its
        directory), then leave the process group."""
        try:
            self.engine.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
