"""Train the DSpark-style confidence head of a model's MTP drafter and ship it in the model folder.

    .venv/bin/python tools/train_confidence_head.py --model deepinfer/models/deepinfer-tiny-coder

Data is on-policy: the engine itself runs greedy speculative decoding (MTP, k drafts per step) over
prompts cut from the held-out stdlib files, and records, for every verified draft, the features the
head sees (statistics of the MTP distribution, the request's acceptance in its previous step, depth)
and whether the draft was accepted. The head is a small MLP on standardised inputs, trained with
binary cross-entropy on 80% of the requests to predict a draft's acceptance given that the drafts
before it were accepted (so the product along a chain is the chance that the whole prefix is
accepted). On the other 20% the threshold is chosen: the largest that keeps the mean accepted length
within ``--max-length-drop`` of fixed-k verification (default 4%, a margin under the 5% goal for the
shift from these prompts to served ones), which minimises verified drafts under that constraint.
``--drafts`` (default 5, as in DSpark) becomes the default chain length of
``speculative="mtp-confidence"``. Deterministic under ``--seed``.
Writes confidence_head/model.safetensors and confidence_head/config.json (threshold and validation
metrics) into the model folder.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.bench.workload import Workload
from deepinfer.worker.spec_decode import ConfidenceHead


def collect(
    model: Path, num_prompts: int, drafts: int, new_tokens: int, seed: int
) -> list[list[tuple[torch.Tensor, bool]]]:
    """Per request: the (features, accepted) pairs of its verified drafts, in order."""
    llm = LLM(str(model), speculative="mtp", num_draft_tokens=drafts)
    proposer = llm.engine.runner.proposer
    prompts = Workload(num_prompts, (32, 512), new_tokens, seed).prompts(llm.engine.tokenizer)
    per_request = []
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts:  # one request at a time: the trace is then that request's
        proposer.trace = []
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        per_request.append(proposer.trace)
    proposer.trace = None
    return per_request


def chains(trace: list[tuple[torch.Tensor, bool]], drafts: int) -> list[list[tuple[torch.Tensor, bool]]]:
    """Split a request's trace into per-step draft chains (depth restarts at 1)."""
    out: list[list[tuple[torch.Tensor, bool]]] = []
    for features, accepted in trace:
        depth = int(features[-1].item())
        if depth == 1 or not out:
            out.append([])
        out[-1].append((features, accepted))
    return [c for c in out if c]


def conditional(chain: list[tuple[torch.Tensor, bool]]) -> list[tuple[torch.Tensor, bool]]:
    """The chain's drafts up to and including its first rejection: the head learns P(draft j accepted
    | drafts before it accepted), so that the product along a chain is the probability of the prefix."""
    out = []
    for features, accepted in chain:
        out.append((features, accepted))
        if not accepted:
            break
    return out


def simulate(head: ConfidenceHead, steps: list[list[tuple[torch.Tensor, bool]]], threshold: float) -> dict:
    """Verified drafts and mean accepted length (tokens per step) if the head gated these chains."""
    verified = accepted = 0
    with torch.no_grad():
        for chain in steps:
            probs = head(torch.stack([f for f, _ in chain])).tolist()
            kept, cumulative = 0, 1.0
            for p in probs:
                cumulative *= p
                if cumulative < threshold:
                    break
                kept += 1
            verified += kept
            for _, ok in chain[:kept]:
                if not ok:
                    break
                accepted += 1
    return {"verified_per_step": verified / len(steps), "mean_accepted_len": 1 + accepted / len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=320)
    parser.add_argument("--drafts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-length-drop", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    traces = collect(args.model, args.prompts, args.drafts, args.new_tokens, args.seed)
    order = list(range(len(traces)))
    random.Random(args.seed).shuffle(order)
    cut = int(0.8 * len(order))
    train = [
        pair for i in order[:cut] for chain in chains(traces[i], args.drafts) for pair in conditional(chain)
    ]
    val_steps = [c for i in order[cut:] for c in chains(traces[i], args.drafts)]
    x = torch.stack([f for f, _ in train])
    y = torch.tensor([float(ok) for _, ok in train])

    head = ConfidenceHead(drafts=args.drafts)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0).clamp_min(1e-3))
    optimiser = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=1e-3)
    loss_fn = nn.BCELoss()
    for _ in range(500):
        optimiser.zero_grad()
        loss = loss_fn(head(x), y)
        loss.backward()
        optimiser.step()
    head.eval()

    fixed = simulate(head, val_steps, 0.0)
    best = (0.0, fixed)
    for threshold in [t / 100 for t in range(1, 100)]:
        gated = simulate(head, val_steps, threshold)
        if gated["mean_accepted_len"] >= fixed["mean_accepted_len"] * (1 - args.max_length_drop):
            best = (threshold, gated)
    threshold, gated = best
    with torch.no_grad():
        accuracy = ((head(x) > 0.5).float() == y).float().mean().item()
    metrics = {
        "trained_on": {"prompts": args.prompts, "drafts": args.drafts, "new_tokens": args.new_tokens, "seed": args.seed,
                       "verified_drafts": len(train), "train_acceptance": y.mean().item(), "train_accuracy": accuracy},
        "validation_fixed_k": fixed,
        "validation_gated": gated,
    }  # fmt: skip
    head.save(args.model, threshold, metrics)
    print(json.dumps({"threshold": threshold, **metrics}, indent=2))


if __name__ == "__main__":
    main()
