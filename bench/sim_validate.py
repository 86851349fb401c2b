"""Simulator vs our engine on this machine: one trace through ``deepinfer serve`` and through the
simulator calibrated here (deepinfer.sim.validation). Writes bench/results/sim_validation.json.

    PYTHONPATH=$PWD .venv/bin/python bench/sim_validate.py      # about 5 minutes on a quiet host

Two servers are started one after the other (one per trace, each calibrating at start-up right
before its trace); the report gives the host's load average around each trace.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from deepinfer.model_zoo import default_model_path
from deepinfer.sim.validation import ServerSettings, TraceSpec, run_validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default="bench/results/sim_validation.json")
    args = parser.parse_args()
    common = {
        "num_requests": args.num_requests,
        "request_rate": args.request_rate,
        "output_len": args.output_len,
    }
    start = time.perf_counter()
    result = run_validation(
        str(default_model_path()), TraceSpec(seed=1, **common), TraceSpec(seed=2, **common), ServerSettings()
    )
    result["wall_s"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"fitted on the calibration trace: step-time factor {result['scale']:.3f}, "
        f"admission delay {result['admission_delay_s'] * 1e3:.1f} ms"
    )
    print(f"wall {result['wall_s']:.0f} s")
    for name in ("calibration", "validation"):
        r = result[name]
        busy = r["engine_busy_s"]
        print(f"{name}: load average before/after {r['load_average_before_after']}; engine busy "
              f"{busy['measured']:.1f} s measured, {busy['simulated']:.1f} s simulated")  # fmt: skip
        print(f"  {'metric':34s} {'measured':>10s} {'simulated':>10s} {'error':>7s}")
        for key, measured in r["measured"].items():
            err = r["errors"].get(key.replace("output_tokens_per_s", "throughput"))
            tail = f"{err:+7.1%}" if err is not None else ""
            print(f"  {key:34s} {measured:10.4f} {r['simulated'][key]:10.4f} {tail}")


if __name__ == "__main__":
    main()
