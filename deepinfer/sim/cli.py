"""``deepinfer plan``: the capacity and cost planner and the published scenarios.

``deepinfer plan --workload W.yaml --slo ttft_p99=2s,tpot_p99=50ms --chip gb200`` searches deployments;
``deepinfer plan --scenario deepseek-2026 [--json]`` recomputes the published arithmetic. ``plan`` is a
command group: further planners (``deepinfer plan memory``) register in :data:`PLAN_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from deepinfer.parallel.plan_cli import add_memory_arguments, run_memory

# name -> (help, add_arguments(parser), run(args) -> exit code). `deepinfer plan memory` goes here.
PLAN_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]] = {
    "memory": (
        "per-rank memory at expert-parallel sizes vs each chip's HBM",
        add_memory_arguments,
        run_memory,
    ),
}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--workload", help="workload spec (YAML): traffic classes, lengths, sessions, TTLs")
    what.add_argument("--scenario", help="a published scenario to recompute: deepseek-2026")
    parser.add_argument("--slo", help="targets, e.g. ttft_p99=2s,tpot_p99=50ms (with --workload)")
    parser.add_argument("--chip", default="gb200", help="gb200 | b200 | h200 | ascend950pr | ascend950dt")
    parser.add_argument(
        "--usd-per-chip-hour", type=float, help="rental price (needed where none is published)"
    )
    parser.add_argument("--usd-per-tb-day", type=float, help="KV storage price (default: storage not priced)")
    parser.add_argument(
        "--max-simulations", type=int, help="deployments simulated with the scheduler (default 6)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="plan.png", help="where to save the figure (with --workload)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    if PLAN_SUBCOMMANDS:
        sub = parser.add_subparsers(dest="plan_command")
        for name, (text, add_arguments, _) in PLAN_SUBCOMMANDS.items():
            add_arguments(sub.add_parser(name, help=text))


def plan(args: argparse.Namespace) -> int:
    """Run ``deepinfer plan``. Bad input (a missing or malformed file, an invalid value, an unknown
    chip, model or scenario) raises ValueError, KeyError or OSError with a one-line message naming
    the file, field or flag: ``deepinfer.cli`` prints it and exits 2. When no deployment meets the
    SLO it prints the closest one and exits 1."""
    command = getattr(args, "plan_command", None)
    if command is not None:
        return PLAN_SUBCOMMANDS[command][2](args)
    if args.scenario:
        from deepinfer.sim.scenario import format_scenario, run_scenario

        try:
            result = run_scenario(args.scenario)
        except ValueError as exc:
            raise ValueError(f"--scenario: {exc}") from None
        print(json.dumps(result) if args.json else format_scenario(result))
        return 0
    if not args.workload or not args.slo:
        raise ValueError("give --workload W.yaml --slo ... (or --scenario NAME)")
    from deepinfer.sim.planner import (
        NoDeploymentMeetsSLO,
        Planner,
        PlanOptions,
        decode_pareto,
        parse_slo,
        plot,
    )
    from deepinfer.sim.workload import WorkloadSpec

    figure = Path(args.plot)
    if not figure.parent.is_dir():
        raise ValueError(f"--plot {figure}: the folder {figure.parent} does not exist")
    spec = WorkloadSpec.load(args.workload)
    try:
        slo = parse_slo(args.slo)
    except ValueError as exc:
        raise ValueError(f"--slo: {exc}") from None
    options = {
        "seed": args.seed,
        "usd_per_chip_hour": args.usd_per_chip_hour,
        "usd_per_tb_day": args.usd_per_tb_day,
    }
    if args.max_simulations is not None:
        options["max_simulations"] = args.max_simulations
    plan_options = PlanOptions(**options)
    try:
        planner = Planner(spec, args.chip, slo, plan_options)
    except KeyError as exc:
        raise ValueError(f"--chip: {exc.args[0]}") from None
    try:
        report = planner.plan()
    except NoDeploymentMeetsSLO as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "closest": exc.closest}))
        raise SystemExit(f"deepinfer plan: {exc}") from None
    context = int(report["simulation"]["prompt_tokens"] / max(1, report["simulation"]["requests_finished"]))
    plot(report, figure, decode_pareto(planner, context))
    report["plot"] = args.plot
    print(json.dumps(report) if args.json else format_plan(report))
    return 0


def format_plan(r: dict) -> str:
    def money(v):
        return "not priced (pass --usd-per-tb-day)" if v is None else f"US${v:.4f}"

    lines = [
        f"cheapest deployment meeting the SLO: {r['deployment']['description']}",
        f"  chips {r['deployment']['chips']} at US${r['usd_per_chip_hour']:.3f}/chip-hour: US${r['usd_per_day']:,.0f}/day",
        "  SLO: " + ", ".join(f"{k} {r['slo_measured'][k] * 1e3:.0f} ms (target {v * 1e3:.0f} ms)" for k, v in r["slo"].items()),
        f"  output tokens/day {r['output_tokens_per_day'] / 1e9:.2f} B; input {r['input_tokens_per_day'] / 1e9:.2f} B, "
        f"of which cached {r['cached_input_tokens_per_day'] / 1e9:.2f} B",
        f"  cost per M tokens: output US${r['usd_per_m_output']:.4f}, uncached input {money(r['usd_per_m_input_uncached'])}, "
        f"cached input {money(r['usd_per_m_input_cached'])}",
        "  cache hit rate by tier: " + ", ".join(f"{k} {v:.1%}" for k, v in r["cache_hit_rate"].items()),
        f"  simulated at the peak hour ({r['peak_hour_utc']:02d} UTC, {r['peak_requests_per_s']:.0f} req/s): "
        f"{r['simulation']['output_tokens_per_s_per_chip']:.0f} tok/s/chip, {r['simulation']['tokens_per_s_per_user']:.0f} "
        f"tok/s/user, balance {r['simulation']['balance']}",
        "  evaluated:",
    ]  # fmt: skip
    for e in r["evaluated"]:
        verdict = (
            "meets" if e["meets"] else "misses " + ", ".join(f"{k} x{v:.2f}" for k, v in e["misses"].items())
        )
        lines.append(f"    US${e['usd_per_day']:>10,.0f}/day  {e['deployment']}: {verdict}")
    lines.append(f"  figure: {r['plot']}   ({r['elapsed_s']:.0f} s)")
    return "\n".join(lines)
