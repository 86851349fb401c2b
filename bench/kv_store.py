"""KV store speed: TTFT of a stored 8,000-token prefix (disk tier, host tier) against a cold prefill,
and offline throughput with the store on (every lookup missing) against the store off.

    .venv/bin/python bench/kv_store.py [--prompt-len 8000] [--reps 3] [--out bench/results/kv_store.json]
    .venv/bin/python bench/kv_store.py --skip-ttft --store-cpu --reps 6 \
        --out bench/results/kv_store_overhead.json
    .venv/bin/python bench/kv_store.py --skip-ttft --skip-throughput --write-path --out /tmp/w.json

TTFT, per rep in this order (so the three alternate): cold (prefix caching off, the same prompt),
disk (a fresh engine on the store path: device and host empty; the prompt's files are dropped from the
page cache with posix_fadvise first, so the disk is really read), host (the same engine after a filler
prompt evicted the prefix from the device). Throughput: ``deepinfer bench offline``'s workload, store
off and store on with a new empty directory each run (every lookup misses, every full block is saved
and written behind), alternated A B B A (each side first in half the pairs); medians; 192 requests
a rep (over 10 s on a quiet 2-core host). ``--store-cpu``: the store's CPU share from thread CPU
times, the measure that survives a loaded host (wall-clock ratios there are noise). The bundled
model's max_model_len is 8192 (max_position_embeddings), so an 8,000-token prompt fits without raising it. ``--swa`` adds the bounded
SWA replay's logit drift on a random sliding-window model (transformers writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.bench.offline import run_offline
from deepinfer.bench.report import environment
from deepinfer.bench.workload import Workload, heldout_stream
from deepinfer.kvstore.config import KVStoreConfig
from deepinfer.malloc_tuning import reexec_with_malloc_tuning

ONE = SamplingParams(temperature=0.0, max_tokens=1)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=ONE)[0]
    return out.metrics.ttft, out.num_cached_tokens, out.outputs[0].token_ids


def drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*.kvp"):  # the disk tier's pack files
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_ttft(prompt_len: int, reps: int, root: Path) -> dict:
    blocks = -(-8192 // 16) + 8
    cold_llm = LLM(max_model_len=8192, enable_prefix_caching=False, num_kv_blocks=blocks)
    stream = heldout_stream(cold_llm.engine.tokenizer)
    rng = random.Random(0)
    start = rng.randrange(len(stream) - 2 * prompt_len)
    prompt, filler = stream[start : start + prompt_len], stream[start + prompt_len : start + 2 * prompt_len]
    store = KVStoreConfig(path=str(root / "store"), host_cache_gib=0.5)
    writer = LLM(max_model_len=8192, num_kv_blocks=blocks, kv_store=store)
    _, _, reference = ttft(writer, prompt)
    writer.engine.kv_connector.store.flush(60)
    writer.engine.kv_connector.close()
    del writer
    ttft(cold_llm, prompt[:64])  # warm-up
    runs = {"cold": [], "disk": [], "host": []}
    cached = {"cold": [], "disk": [], "host": []}
    for _ in range(reps):
        t, c, tokens = ttft(cold_llm, prompt)
        runs["cold"].append(t)
        cached["cold"].append(c)
        assert tokens == reference
        drop_page_cache(root / "store")
        llm = LLM(max_model_len=8192, num_kv_blocks=blocks, kv_store=store)
        ttft(llm, filler[:64])  # warm-up, unrelated tokens
        t, c, tokens = ttft(llm, prompt)
        runs["disk"].append(t)
        cached["disk"].append(c)
        assert tokens == reference
        ttft(llm, filler)  # evicts the prefix from the device cache (the host tier keeps it)
        t, c, tokens = ttft(llm, prompt)
        runs["host"].append(t)
        cached["host"].append(c)
        assert tokens == reference
        stats = llm.engine.kv_store_stats()
        llm.engine.kv_connector.close()
        del llm
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "prompt_tokens": prompt_len,
        "ttft_s": runs,
        "median_ttft_s": med,
        "cached_tokens": cached,
        "speedup_disk_vs_cold": med["cold"] / med["disk"],
        "speedup_host_vs_cold": med["cold"] / med["host"],
        "last_engine_store_stats": stats,
        "env": environment(cold_llm.engine),
    }


def _cpu_seconds() -> float:
    """This process's user + system CPU time, every thread (the store's writer and readers too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_throughput(reps: int, root: Path, num_requests: int, after_pair: Callable[[dict], None]) -> dict:
    """Offline throughput, store off and store on (a new empty directory each run, so every lookup
    misses and every full block is saved and written behind), alternated A B B A; medians. Each rep
    records its wall time (a rep under 10 s is too short to trust on a noisy machine: raise
    ``--num-requests``), the load average around it and the process's CPU time (every thread, the
    store's writer included): CPU seconds per output token is the overhead's second, less
    load-sensitive measure. ``after_pair`` gets the summary so far after each off/on pair (the caller
    saves it, so a run cut short still leaves its completed pairs)."""
    workload = Workload(num_requests=num_requests)
    results: dict[str, list[float]] = {"off": [], "on_all_miss": []}
    cpu: dict[str, list[float]] = {"off": [], "on_all_miss": []}  # process CPU s per output token
    reps_log = []
    env = None
    for rep in range(reps):
        sides = ("off", "on_all_miss") if rep % 2 == 0 else ("on_all_miss", "off")  # A B B A: no order bias
        for side in sides:
            store = KVStoreConfig(path=str(root / f"miss-{rep}")) if side == "on_all_miss" else None
            llm = LLM(kv_store=store)
            env = env or environment(llm.engine)
            load_before = os.getloadavg()[0]
            cpu_before = _cpu_seconds()
            r = run_offline(llm, workload)
            cpu_s = _cpu_seconds() - cpu_before
            store_log = {}
            if store is not None:
                t0 = time.perf_counter()
                llm.engine.kv_connector.close()  # drains the write-behind backlog (not timed above)
                stats = llm.engine.kv_store_stats()
                assert stats["hit_blocks"] == 0, f"expected every lookup to miss, {stats['hit_blocks']} hit"
                assert stats["misses"] > 0, "the store saw no lookup"
                store_log = {
                    "blocks_saved": stats["tiers"]["host"]["writes"],
                    "blocks_written_to_disk": stats["tiers"]["disk"]["writes"],
                    "writes_dropped": stats["writes_dropped"],
                    "saves_refused": stats["saves_refused"],
                    "backlog_drain_s": time.perf_counter() - t0,
                }
            results[side].append(r["output_tokens_per_s"])
            cpu[side].append(cpu_s / r["output_tokens"])
            reps_log.append(
                {
                    "rep": rep,
                    "side": side,
                    "wall_s": r["wall_s"],
                    "output_tokens_per_s": r["output_tokens_per_s"],
                    "cpu_s": cpu_s,
                    "load_1m_before": load_before,
                    "load_1m_after": os.getloadavg()[0],
                    **store_log,
                }
            )
            print(json.dumps(reps_log[-1]), flush=True)
            del llm
        after_pair(_summary(results, cpu, reps_log, workload, env))
    return _summary(results, cpu, reps_log, workload, env)


def _summary(results: dict, cpu: dict, reps_log: list, workload: Workload, env: dict | None) -> dict:
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "pairs": len(results["off"]),
        "output_tokens_per_s": results,
        "median_output_tokens_per_s": med,
        "ratio_on_over_off": med["on_all_miss"] / med["off"],
        "cpu_s_per_output_token": cpu,
        "cpu_ratio_on_over_off": statistics.median(cpu["on_all_miss"]) / statistics.median(cpu["off"]),
        "min_rep_wall_s": min(r["wall_s"] for r in reps_log),
        "writes_dropped": sum(r.get("writes_dropped", 0) for r in reps_log),
        "blocks_written_to_disk": sum(r.get("blocks_written_to_disk", 0) for r in reps_log),
        "reps": reps_log,
        "workload": workload.describe(),
        "env": env,
    }


def _thread_cpu_s(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process (Linux /proc)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_store_cpu(root: Path, num_requests: int) -> dict:
    """The store's CPU share with every lookup missing, from thread CPU times (CPU time, unlike wall
    time, barely moves with the machine's load): the engine thread's CPU inside the connector's calls
    (lookups at admission, save bookkeeping, device -> host copies after each forward, polling) and
    the store's own threads' CPU (write-behind with checksums and fsync, loaders), against the engine
    thread's CPU for the whole run."""
    import threading

    llm = LLM(kv_store=KVStoreConfig(path=str(root / "cpu-account")))
    connector = llm.engine.kv_connector
    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.thread_time() - t0

        return call

    for name in ("begin_load", "poll", "saves", "save_blocks"):
        setattr(connector, name, timed(name, getattr(connector, name)))
    store_threads = [t for t in threading.enumerate() if t.name.startswith("deepinfer-kv-")]
    before = {t.native_id: _thread_cpu_s(t.native_id) for t in store_threads}
    main0 = time.thread_time()
    r = run_offline(llm, Workload(num_requests=num_requests))
    main_s = time.thread_time() - main0
    connector.store.flush(120)
    store_threads = [t for t in threading.enumerate() if t.name.startswith("deepinfer-kv-")]
    threads_s = sum(_thread_cpu_s(t.native_id) - before.get(t.native_id, 0.0) for t in store_threads)
    stats = llm.engine.kv_store_stats()
    assert stats["hit_blocks"] == 0, f"expected every lookup to miss, {stats['hit_blocks']} hit"
    connector.close()
    stats = llm.engine.kv_store_stats()
    engine_side = sum(spent.values())
    return {
        "engine_thread_cpu_s": main_s,
        "engine_thread_cpu_in_store_calls_s": spent,
        "store_threads_cpu_s": threads_s,
        "store_share_of_engine_thread": engine_side / main_s,
        "store_cpu_over_engine_thread_cpu": (engine_side + threads_s) / main_s,
        "blocks_written": stats["tiers"]["disk"]["writes"],
        "writes_dropped": stats["writes_dropped"],
        "wall_s": r["wall_s"],
        "output_tokens": r["output_tokens"],
        "load_1m": os.getloadavg(),
        "workload": Workload(num_requests=num_requests).describe(),
    }


def bench_write_path(
    root: Path,
    blocks: int = 2000,
    step: int = 40,
    slot_bytes: int = 25600,
    write_window_s: float = KVStoreConfig().write_window_ms / 1e3,
) -> dict:
    """The write-behind's CPU per saved block, without an engine: ``blocks`` blocks of ``slot_bytes``
    (the bundled model's block size) reserved, filled and committed ``step`` at a time with 10 ms
    between steps (an engine step), then flushed. Engine-thread CPU of the commits, the writer
    thread's CPU, and the time until every block is durable. ``write_window_s``: the store's
    group-commit window (the engine's default)."""
    import hashlib

    from deepinfer.kvstore.keys import StoreNamespace, store_key
    from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy
    from deepinfer.kvstore.store import DirSpec, KVStore

    ns = StoreNamespace("weights", "tok", "layout", 16, "float32", (0,), "full")
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    store = KVStore(
        ns,
        slot_bytes,
        2 * blocks,
        policy,
        disk=DirSpec(root / "write-path", 1 << 34),
        write_window_s=write_window_s,
    )
    writer0 = _thread_cpu_s(store._writer.native_id)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    for first in range(0, blocks, step):
        for i in range(first, min(first + step, blocks)):
            slot = store.reserve()
            store.slot(slot).fill_(i % 251)
            store.commit(store_key(ns.digest(), hashlib.sha256(b"%d" % i).digest()[:16]), slot, "chat")
        time.sleep(0.01)
    engine_s = time.thread_time() - cpu0
    assert store.flush(600), "the write-behind did not drain in 600 s"
    wall = time.perf_counter() - t0
    writer_s = _thread_cpu_s(store._writer.native_id) - writer0
    stats = store.snapshot()
    store.close()
    return {
        "blocks": blocks,
        "slot_bytes": slot_bytes,
        "write_window_s": write_window_s,
        "engine_thread_ms_per_block": 1e3 * engine_s / blocks,
        "writer_thread_ms_per_block": 1e3 * writer_s / blocks,
        "wall_until_durable_s": wall,
        "blocks_written": stats["tiers"]["disk"]["writes"],
        "writes_dropped": stats["writes_dropped"],
        "load_1m": os.getloadavg(),
    }


def bench_swa_drift(root: Path) -> dict:
    """Bounded replay's drift: max |logprob| difference over the top-20 of 8 greedy steps, against a
    cold run, on a random 3-layer model (2 sliding-window layers, window 64) and a 600-token prompt."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
               qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
               max_position_embeddings=1024, initializer_range=0.1, num_nextn_predict_layers=0)  # fmt: skip
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    folder = root / "swa-model"
    model.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(sliding_window=64, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    (folder / "config.json").write_text(json.dumps(raw))
    prompt = [(i * 37 + 11) % 250 + 2 for i in range(600)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)

    def rows(out):
        return [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]

    cold = rows(LLM(model=str(folder)).generate(prompt_token_ids=[prompt], sampling_params=sp)[0])
    out = {}
    for mode, tokens in (("exact", 128), ("bounded", 128), ("bounded", 64), ("bounded", 32)):
        store = KVStoreConfig(path=str(root / f"swa-{mode}-{tokens}"), host_cache_gib=0.05, swa_replay=mode,
                              swa_replay_tokens=tokens)  # fmt: skip
        first = LLM(model=str(folder), kv_store=store)
        first.generate(prompt_token_ids=[prompt], sampling_params=sp)
        first.engine.kv_connector.close()  # one owner per disk tier directory: the next engine takes it
        hit = rows(
            LLM(model=str(folder), kv_store=store).generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
        )
        drift = max(abs(a[t] - b[t]) for a, b in zip(hit, cold) for t in a.keys() & b.keys())
        out[f"{mode}_{tokens if mode == 'bounded' else 'receptive_field'}"] = drift
    return {"max_abs_logprob_drift": out, "window": 64, "swa_layers": 2, "prompt_tokens": 600}


def main() -> None:
    reexec_with_malloc_tuning()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true", help="only the store-off vs all-miss throughput")
    ap.add_argument("--num-requests", type=int, default=192, help="requests per throughput rep")
    ap.add_argument("--store-cpu", action="store_true", help="the store's CPU share (thread CPU times)")
    ap.add_argument("--swa", action="store_true")
    ap.add_argument("--write-path", action="store_true", help="the write-behind's CPU per block (no engine)")
    ap.add_argument("--out", default="bench/results/kv_store.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        result: dict = {}
        if not args.skip_ttft:
            result["ttft"] = bench_ttft(args.prompt_len, args.reps, root)
            print(
                json.dumps(
                    {
                        k: result["ttft"][k]
                        for k in ("median_ttft_s", "speedup_disk_vs_cold", "speedup_host_vs_cold")
                    }
                )
            )
        if not args.skip_throughput:

            def save_partial(summary: dict) -> None:
                Path(args.out).write_text(json.dumps({**result, "throughput": summary}, indent=1) + "\n")

            result["throughput"] = bench_throughput(args.reps, root, args.num_requests, save_partial)
            print(
                json.dumps(
                    {k: result["throughput"][k] for k in ("median_output_tokens_per_s", "ratio_on_over_off")}
                )
            )
        if args.store_cpu:
            result["store_cpu"] = bench_store_cpu(root, args.num_requests)
            print(json.dumps(result["store_cpu"]))
        if args.write_path:
            result["write_path"] = bench_write_path(root)
            print(json.dumps(result["write_path"]))
        if args.swa:
            result["swa"] = bench_swa_drift(root)
            print(json.dumps(result["swa"]))
        result["bench_wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
