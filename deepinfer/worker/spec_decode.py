"""Speculative drafting with the model's MTP layer, and DSpark-style confidence gating.

After each step, for every request that sampled, the MTP layer proposes ``k`` draft tokens by chaining
itself: the first pass runs over all of the step's positions (the main model's final hidden state at
position i and the token at i+1), which also fills the MTP layer's KV cache; each further draft feeds
the previous MTP output and draft back in. Drafts are greedy (the MTP argmax), so verification by
sampling the target at each draft position is lossless (see ``ModelRunner._sample_and_verify``).

With a confidence head, a request keeps only the draft prefix whose predicted cumulative acceptance
stays at or above a threshold, so the number of verified tokens adapts per request and step; a
request stops drafting at its first draft below the threshold.

Known limit: with prefix caching, the MTP cache row at the last position of a shared block was written
with the next token of the request that computed it; drafts there may be worse, never wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from deepinfer.backends import ops
from deepinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer.worker.inputs import InputBuilder, StepInputs

# A subfolder of the model folder: model loaders that glob the top level for *.safetensors (vLLM,
# llama.cpp's converter) must not mistake the head for model weights.
CONFIDENCE_DIR = "confidence_head"


class ConfidenceHead(nn.Module):
    """Predicts the probability that a draft token is accepted, given that the drafts before it were.

    Features (``NUM_FEATURES``, in this order): of the MTP layer's output distribution at the draft, log
    of the top-1 (the draft's) probability and of its complement, log of the top-2 probability and the
    entropy; of the request's previous step, the share of its verified drafts that were accepted, whether
    it verified any, and whether all were accepted (acceptance runs in streaks: copied or boilerplate
    code accepts whole chains); and the draft's depth (1-based) in the chain, last. The inputs are
    standardised with the training set's mean and deviation (buffers, saved with the weights). (The MTP
    hidden state itself was tried as an input too: on our traces it overfits — validation AUC 0.74
    against 0.81 for the draft probability alone — so it is left out.)
    """

    NUM_FEATURES = 8

    def __init__(self, width: int = 16, drafts: int = 1) -> None:
        """``drafts``: the chain length the head was trained on, the default k for mtp-confidence."""
        super().__init__()
        self.width = width
        self.drafts = drafts
        self.net = nn.Sequential(nn.Linear(self.NUM_FEATURES, width), nn.SiLU(), nn.Linear(width, 1))
        self.register_buffer("mean", torch.zeros(self.NUM_FEATURES))
        self.register_buffer("std", torch.ones(self.NUM_FEATURES))

    @staticmethod
    def features(probs: Tensor, previous: Tensor, depth: int) -> Tensor:
        """probs: [N, V] the MTP softmax; previous: [N, 2] float32 (drafts verified, drafts accepted) in
        each request's previous step -> [N, NUM_FEATURES] float32."""
        probs = probs.float()
        top = probs.topk(2, dim=-1).values.clamp(1e-6, 1 - 1e-6)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
        verified, accepted = previous.to(probs.device).unbind(-1)
        any_verified = (verified > 0).float()
        share = accepted / verified.clamp_min(1.0)
        all_accepted = any_verified * (accepted == verified).float()
        depth_col = torch.full_like(entropy, float(depth))
        return torch.stack(
            (top[:, 0].log(), (-top[:, 0]).log1p(), top[:, 1].log(), entropy, share, any_verified,
             all_accepted, depth_col),
            dim=-1,
        )  # fmt: skip

    def forward(self, features: Tensor) -> Tensor:
        """features [N, NUM_FEATURES] -> acceptance probability [N]."""
        return torch.sigmoid(self.net((features - self.mean) / self.std)).squeeze(-1)

    def save(self, folder: Path, threshold: float, metrics: dict) -> None:
        """Write ``<folder>/confidence_head/{model.safetensors,config.json}``."""
        target = folder / CONFIDENCE_DIR
        target.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, target / "model.safetensors")
        config = {"width": self.width, "drafts": self.drafts, "threshold": threshold, **metrics}
        (target / "config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, folder: Path) -> tuple[ConfidenceHead, float]:
        """The head shipped in a model folder and its default threshold."""
        config_path = folder / CONFIDENCE_DIR / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{folder} has no {CONFIDENCE_DIR}/config.json: speculative 'mtp-confidence' needs a trained "
                "confidence head (tools/train_confidence_head.py makes one)"
            )
        config = json.loads(config_path.read_text())
        head = cls(config["width"], config["drafts"])
        head.load_state_dict(load_file(folder / CONFIDENCE_DIR / "model.safetensors"))
        return head.eval(), float(config["threshold"])


@dataclass(slots=True)
class DraftChain:
    """The drafts of one request, with the confidence features of each."""

    request_id: str
    tokens: list[int]
    accept_prob: list[float]
    features: list[Tensor] = field(default_factory=list)  # filled only while tracing


class MTPProposer:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: Sequence[Sequence[Tensor]],
        inputs: InputBuilder,
        num_drafts: int,
        confidence: tuple[ConfidenceHead, float] | None = None,
    ) -> None:
        if not model.mtp_layers:
            raise ValueError(
                "speculative decoding with MTP needs a model with MTP layers (num_nextn_predict_layers)"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.prepare = inputs.prepare  # host batch -> StepInputs (the runner's builder)
        self.num_drafts = num_drafts
        self.head, self.threshold = confidence if confidence is not None else (None, 0.0)
        # Set to a list to collect (features, accepted) pairs for training a confidence head.
        self.trace: list[tuple[Tensor, bool]] | None = None
        self._pending_features: dict[str, list[Tensor]] = {}
        # This step's verification per request (drafts verified, accepted): confidence features of the
        # drafts proposed right after it. Filled by record_verification, emptied by propose.
        self._verified_now: dict[str, tuple[int, int]] = {}

    def propose(
        self, inputs: StepInputs, hidden: Tensor, emitted: dict[str, list[int]]
    ) -> tuple[dict[str, list[int]], int]:
        """Drafts for every request in ``emitted``; returns (request id -> kept drafts, drafts proposed)."""
        passes, rows = [], []
        for i, r in enumerate(inputs.order):
            offset = inputs.token_offsets[i]
            if r.request_id in emitted:
                tokens = emitted[r.request_id]
                count = r.num_new_tokens - r.num_draft_tokens + len(tokens) - 1
                next_ids = [*r.token_ids[1:count], tokens[-1]]
            else:
                count = r.num_new_tokens
                start, stop = r.num_computed_tokens + 1, r.num_computed_tokens + count + 1
                prompt = r.prompt_token_ids  # known tokens: prompt then output (sliced, not joined)
                tail = r.output_token_ids[max(start - len(prompt), 0) : max(stop - len(prompt), 0)]
                next_ids = prompt[start:stop] + tail
            passes.append(replace(r, token_ids=next_ids, num_draft_tokens=0, samples=r.request_id in emitted))
            rows.append(list(range(offset, offset + count)))

        mtp_inputs = self.prepare(passes)
        by_id = {p.request_id: rows[i] for i, p in enumerate(passes)}
        order_rows = [row for p in mtp_inputs.order for row in by_id[p.request_id]]
        previous = hidden[torch.tensor(order_rows, device=hidden.device)]
        mtp_hidden, logits = self.model.mtp_forward(
            0, mtp_inputs.input_ids, mtp_inputs.positions, previous, mtp_inputs.meta, self.kv_caches
        )

        chains: list[DraftChain] = []
        last_rows, steps = [], []
        for p, offset in zip(mtp_inputs.order, mtp_inputs.token_offsets):
            if p.samples:
                last_rows.append(offset + p.num_new_tokens - 1)
                chains.append(DraftChain(p.request_id, [], []))
                steps.append(p)
        index = torch.tensor(last_rows, device=hidden.device)
        step_hidden, step_logits = mtp_hidden[index], logits[index]
        last_step = torch.tensor(
            [self._verified_now.get(c.request_id, (0, 0)) for c in chains], dtype=torch.float32
        )
        self._verified_now.clear()
        active = list(range(len(chains)))  # the chains still drafting, in the rows of step_hidden
        for depth in range(1, self.num_drafts + 1):
            probs = torch.softmax(step_logits, dim=-1)
            draft = ops.greedy(probs).tolist()
            features = None
            if self.head is not None or self.trace is not None:
                features = ConfidenceHead.features(probs, last_step[active], depth)
            accept = self.head(features).tolist() if self.head is not None else [1.0] * len(active)
            for row, (i, token, a) in enumerate(zip(active, draft, accept)):
                chains[i].tokens.append(token)
                chains[i].accept_prob.append(a)
                if self.trace is not None:
                    chains[i].features.append(features[row].cpu())
            # A chain whose predicted prefix acceptance fell below the threshold drafts no further:
            # nothing after that draft would be verified.
            alive = [
                row for row, i in enumerate(active) if math.prod(chains[i].accept_prob) >= self.threshold
            ]
            if depth == self.num_drafts or not alive:
                break
            if len(alive) < len(active):
                steps, draft = [steps[row] for row in alive], [draft[row] for row in alive]
                step_hidden = step_hidden[torch.tensor(alive, device=step_hidden.device)]
                active = [active[row] for row in alive]
            # Next draft: the MTP layer at the following position, fed its own output and the draft.
            steps = [
                replace(
                    s,
                    token_ids=[t],
                    num_computed_tokens=s.num_computed_tokens + s.num_new_tokens,
                    samples=True,
                )
                for s, t in zip(steps, draft)
            ]
            chain_inputs = self.prepare(steps)
            step_hidden, step_logits = self.model.mtp_forward(
                min(depth, len(self.model.mtp_layers) - 1),
                chain_inputs.input_ids,
                chain_inputs.positions,
                step_hidden,
                chain_inputs.meta,
                self.kv_caches,
            )
        proposed = sum(len(c.tokens) for c in chains)
        if self.trace is not None:
            self._pending_features = {c.request_id: c.features for c in chains}
        return {c.request_id: self._kept(c) for c in chains}, proposed

    def record_verification(self, request_id: str, verified: int, accepted: int) -> None:
        """Note a request's verification for the next drafts' confidence features; while tracing, pair
        each verified draft's features with whether it was accepted."""
        self._verified_now[request_id] = (verified, accepted)
        features = self._pending_features.pop(request_id, None) if self.trace is not None else None
        if features is not None:
            self.trace.extend((features[j], j < accepted) for j in range(verified))

    def _kept(self, chain: DraftChain) -> list[int]:
        """The longest draft prefix whose predicted cumulative acceptance is >= the threshold."""
        if self.head is None:
            return chain.tokens
        kept, cumulative = 0, 1.0
        for a in chain.accept_prob:
            cumulative *= a
            if cumulative < self.threshold:
                break
            kept += 1
        return chain.tokens[:kept]
