"""A planner run for the 1,000 requests/s chat + agent mix (examples/workloads/chat_agent.yaml) on
GB200: how long it takes here and what it picks. Writes bench/results/sim_plan.json and the figure.

    PYTHONPATH=$PWD .venv/bin/python bench/sim_plan.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from deepinfer.sim.planner import Planner, PlanOptions, decode_pareto, parse_slo, plot
from deepinfer.sim.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    spec = WorkloadSpec.load(ROOT / "examples" / "workloads" / "chat_agent.yaml")
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    planner = Planner(spec, "gb200", parse_slo("ttft_p99=2s,tpot_p99=50ms"), PlanOptions())
    report = planner.plan()
    report["wall_s"] = time.perf_counter() - wall
    report["cpu_s"] = time.process_time() - cpu
    report["load_average_before"], report["load_average_after"] = load_before, os.getloadavg()
    out = ROOT / "bench" / "results"
    plot(report, out / "sim_plan.png", decode_pareto(planner, 8192))
    (out / "sim_plan.json").write_text(json.dumps(report, indent=2))
    print(f"{report['deployment']['description']}: US${report['usd_per_day']:,.0f}/day, "
          f"wall {report['wall_s']:.0f} s, cpu {report['cpu_s']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
