"""Speculative decoding with the MTP layer: lossless outputs, honest counters, confidence gating."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model_zoo import default_model_path
from deepinfer.worker.spec_decode import ConfidenceHead
from tests.model.hf_models import add_mtp_weights, make_hf_checkpoint

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef read_config(path):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i, line in enumerate(lines):\n",
]


@pytest.fixture(scope="module")
def mtp_model() -> Path:
    """The shipped deepinfer-tiny-coder: a trained MTP layer, so drafts are often, not always, right."""
    return default_model_path()


def model_without_head(model: Path, folder: Path) -> Path:
    """A copy of the model folder's files, without its confidence_head/ subfolder."""
    folder.mkdir()
    for f in model.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "options",
    [dict(num_kv_blocks=200), dict(num_kv_blocks=13, enable_prefix_caching=False, max_num_batched_tokens=24)],
    ids=["roomy", "preempting-chunked"],
)
def test_greedy_outputs_are_identical_with_and_without_speculation(
    mtp_model: Path, k: int, options: dict
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(mtp_model), **options).generate(PROMPTS, params)
    spec_llm = LLM(str(mtp_model), speculative="mtp", num_draft_tokens=k, **options)
    spec = spec_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = spec_llm.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.verified_tokens <= stats.draft_tokens
    assert stats.emitted_tokens == stats.accepted_tokens + stats.request_steps
    assert stats.emitted_tokens == sum(len(o.token_ids) for o in spec)
    assert stats.mean_accepted_len > 1.0
    assert spec_llm.engine.kv_cache.num_free_blocks == options["num_kv_blocks"]


def test_seeded_sampling_and_stops_are_identical_too(mtp_model: Path) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=30, stop_token_ids=[17], logprobs=2)
    plain = LLM(str(mtp_model), num_kv_blocks=200).generate(PROMPTS, params)
    spec = LLM(str(mtp_model), num_kv_blocks=200, speculative="mtp", num_draft_tokens=2).generate(
        PROMPTS, params
    )
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [next(iter(e)) for e in b.outputs[0].logprobs] == b.token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)


def test_sampled_distribution_matches_the_target(tmp_path: Path) -> None:
    """Chi-square test of the second generated token (the first one that goes through draft
    verification) against its exact marginal under the target model, over 3,000 seeded samples.

    Power: 16 categories, N = 3000, alpha = 0.001. Moving 5% of the probability mass between two
    cells of probability ~1/16 gives a noncentrality of about 3000 * 2 * 0.05^2 / 0.0625 = 240,
    far above the critical value of ~37.7: such a bias would be detected with power ~1.
    """
    hf = make_hf_checkpoint(tmp_path / "hf", vocab_size=16, initializer_range=0.3)
    add_mtp_weights(hf, tmp_path / "hf", tmp_path / "mtp", seed=5)
    prompt = [3, 9, 4, 11]
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
        second = sum(
            first[t] * torch.softmax(hf(torch.tensor([[*prompt, t]])).logits[0, -1], dim=-1)
            for t in range(16)
        )
    llm = LLM(str(tmp_path / "mtp"), num_kv_blocks=600, speculative="mtp", num_draft_tokens=1)
    # max_tokens=3: the second token is drafted and verified (the step may emit the third as well)
    params = [
        SamplingParams(n=100, temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(30)
    ]
    outs = llm.generate(prompt_token_ids=[prompt] * 30, sampling_params=params)
    counts = torch.zeros(16)
    for out in outs:
        for c in out.outputs:
            counts[c.token_ids[1]] += 1
    stats = llm.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.verified_tokens  # both acceptance and rejection happened
    expected = second * counts.sum()
    keep = expected >= 5  # pool rare categories, as chi-square requires
    observed, expect = counts[keep], expected[keep]
    if (~keep).any():
        observed = torch.cat((observed, counts[~keep].sum()[None]))
        expect = torch.cat((expect, expected[~keep].sum()[None]))
    chi2 = float(((observed - expect) ** 2 / expect).sum())
    dof = len(observed) - 1
    critical = (
        dof + 3.09 * math.sqrt(2 * dof) + 3.09**2 * 2 / 3
    )  # ~chi-square 0.999 quantile (Wilson-Hilferty-ish)
    assert chi2 < critical, f"chi2={chi2:.1f} >= {critical:.1f} with {dof} dof"


def test_confidence_gating_verifies_fewer_drafts_and_stays_lossless(mtp_model: Path, tmp_path: Path) -> None:
    folder = model_without_head(mtp_model, tmp_path / "gated")
    torch.manual_seed(0)
    head = ConfidenceHead()
    with torch.no_grad():
        head.net[2].bias.fill_(0.0)  # a head that predicts ~50% acceptance
    head.save(folder, threshold=0.3, metrics={})
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    fixed = LLM(str(folder), num_kv_blocks=200, speculative="mtp", num_draft_tokens=3)
    fixed_out = fixed.generate(PROMPTS, params)
    for threshold in (0.0, 0.3):
        gated = LLM(str(folder), num_kv_blocks=200, speculative="mtp-confidence", num_draft_tokens=3,
                    confidence_threshold=threshold)  # fmt: skip
        out = gated.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in fixed_out]
        g, f = gated.engine.spec_stats, fixed.engine.spec_stats
        if threshold == 0.0:
            assert (g.draft_tokens, g.verified_tokens) == (f.draft_tokens, f.verified_tokens)
        else:  # chains stop drafting at their first draft below the threshold
            assert g.verified_tokens < g.draft_tokens < f.draft_tokens
            assert g.verified_tokens < f.verified_tokens


def test_confidence_features_carry_the_requests_previous_step(mtp_model: Path) -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25], [0.4, 0.4, 0.2]])
    previous = torch.tensor([[0.0, 0.0], [3.0, 3.0], [4.0, 1.0]])  # (verified, accepted)
    f = ConfidenceHead.features(probs, previous, depth=2)
    assert f.shape == (3, ConfidenceHead.NUM_FEATURES)
    assert torch.allclose(f[:, 0], probs[:, 0].log()) and torch.allclose(f[:, 2], probs[:, 1].log())
    assert f[:, 4].tolist() == [0.0, 1.0, 0.25]  # share accepted
    assert f[:, 5].tolist() == [0.0, 1.0, 1.0]  # verified any
    assert f[:, 6].tolist() == [0.0, 1.0, 0.0]  # accepted all
    assert f[:, 7].tolist() == [2.0, 2.0, 2.0]  # depth, last

    # In the engine, a request's drafts see the verification of the step that proposed them.
    llm = LLM(str(mtp_model), num_kv_blocks=200, speculative="mtp", num_draft_tokens=3)
    proposer = llm.engine.runner.proposer
    proposer.trace = []
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    chains: list[list[tuple[torch.Tensor, bool]]] = []
    for features, accepted in proposer.trace:
        if features[-1] == 1:
            chains.append([])
        chains[-1].append((features, accepted))
    assert len(chains) > 3 and not proposer._verified_now
    assert chains[0][0][0][5] == 0.0  # the first drafts follow the prefill: nothing verified before
    for before, after in itertools.pairwise(chains):
        accepted = sum(ok for _, ok in before)
        assert after[0][0][4].item() == pytest.approx(accepted / len(before))
        assert after[0][0][6].item() == float(accepted == len(before))


def test_mtp_confidence_drafts_as_deep_as_its_head_was_trained(mtp_model: Path, tmp_path: Path) -> None:
    folder = model_without_head(mtp_model, tmp_path / "head")
    ConfidenceHead(drafts=4).save(folder, threshold=0.5, metrics={})
    assert LLM(str(folder), num_kv_blocks=64, speculative="mtp-confidence").engine.num_draft_tokens == 4
    chosen = LLM(str(folder), num_kv_blocks=64, speculative="mtp-confidence", num_draft_tokens=2)
    assert chosen.engine.num_draft_tokens == 2
    assert LLM(str(folder), num_kv_blocks=64, speculative="mtp").engine.num_draft_tokens == 1


def test_configuration_errors_are_clear(tiny_model: Path, mtp_model: Path) -> None:
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(str(tiny_model), num_kv_blocks=64, speculative="mtp")
    with pytest.raises(FileNotFoundError, match=r"confidence_head/config\.json"):
        LLM(str(tiny_model), num_kv_blocks=64, speculative="mtp-confidence")
    with pytest.raises(ValueError, match="need speculative"):
        LLM(str(mtp_model), num_kv_blocks=64, num_draft_tokens=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(mtp_model), num_kv_blocks=64, speculative="mtp", async_scheduling=True)
