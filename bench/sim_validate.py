"""Simulator vs our serving stack on this machine (deepinfer.sim.validation): a calibration trace and
a held-out trace through one aggregated ``deepinfer serve`` and through a 1 prefill + 1 decode
``deepinfer cluster``, and through the simulator calibrated on the calibration trace's served steps.
Writes bench/results/sim_validation.json and prints the tables.

    PYTHONPATH=$PWD .venv/bin/python bench/sim_validate.py   # est. 6-7 min on a quiet host (443 s for
                                                              # --num-requests 32 at load 8-11)

The report gives the host's load average around each trace. ``--setups disaggregated --num-requests
40`` is the smallest run that shows the P/D case (about 2.5 min); ``--keep DIR`` records the run (step
logs, client results) and ``--recheck DIR`` fits and simulates it again in seconds, serving nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from deepinfer.model_zoo import default_model_path
from deepinfer.sim.validation import SETUPS, ServerSettings, TraceSpec, recheck, run_validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--out", default="bench/results/sim_validation.json")
    parser.add_argument("--keep", type=Path, help="record the run (step logs, client results) in this folder")
    parser.add_argument(
        "--recheck", type=Path, help="fit and simulate a run recorded with --keep again; serve nothing"
    )
    args = parser.parse_args()
    common = {
        "num_requests": args.num_requests,
        "request_rate": args.request_rate,
        "output_len": args.output_len,
    }
    start = time.perf_counter()
    load = os.getloadavg()
    if args.recheck is not None:
        result = recheck(args.recheck)
    else:
        result = run_validation(
            str(default_model_path()),
            TraceSpec(seed=1, **common),
            TraceSpec(seed=2, **common),
            ServerSettings(),
            tuple(args.setups),
            args.keep,
        )
    result["wall_s"] = time.perf_counter() - start
    result["load_average_start_end"] = (load, os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wall {result['wall_s']:.0f} s; load average at start {load}, at end {os.getloadavg()}")
    for setup in [s for s in SETUPS if s in result]:
        r = result[setup]
        fits = r["fitted_on_calibration"]
        print(f"\n{setup}: fitted on the calibration trace: front {fits['front']}; handoff {fits['handoff']}")
        for name in ("calibration", "validation"):
            t = r[name]
            busy = t["engine_busy_s"]
            print(f"  {name}: load average before/after {t['load_average_before_after']}")
            print(
                f"    engine steps' periods, summed: measured {busy['measured_period']}, simulated {busy['simulated_period']}"
            )
            print(f"    {'metric':22s} {'measured':>10s} {'simulated':>10s} {'error':>7s}")
            for key, simulated in t["simulated"].items():
                err = t["errors"][key.replace("output_tokens_per_s", "throughput")]
                print(f"    {key:22s} {t['measured'][key]:10.4f} {simulated:10.4f} {err:+7.1%}")
            per_event = [t["measured"][f"tpot_per_event_{q}"] for q in ("p50", "p90")]
            print(
                f"    (the load generator's TPOT per SSE event, p50/p90: {per_event[0]:.4f} / {per_event[1]:.4f})"
            )


if __name__ == "__main__":
    main()
