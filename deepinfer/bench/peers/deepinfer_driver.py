"""deepinfer's side of a peer comparison: the same job format as the peer drivers."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(job_path: str, result_path: str) -> None:
    import torch

    from deepinfer.bench.offline import run_offline
    from deepinfer.bench.workload import Workload
    from deepinfer.llm import LLM

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    llm = LLM(job["model"], **job.get("engine_options", {}))
    prompts = job["prompts"]
    workload = Workload(len(prompts), (min(map(len, prompts)), max(map(len, prompts))), job["output_len"])
    result = run_offline(llm, workload, prompts)
    result["config"] = {"engine": "deepinfer", **result["env"]["engine_config"], "threads": job["threads"]}
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
