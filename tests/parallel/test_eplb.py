"""EPLB as a pure function: DeepSeek's published example, invariants, and never worse than identity."""

from __future__ import annotations

import pytest
import torch

from deepinfer.parallel.eplb import balancedness, identity_placement, rebalance_experts

# The example of deepseek-ai/EPLB's README: 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def test_hierarchical_placement_equals_deepseek_readme_example() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert log2phy.shape == (2, 12, 5) and logcnt.shape == (2, 12)


def _check_invariants(weight: torch.Tensor, slots: int, phy2log, log2phy, logcnt) -> None:
    layers, experts = weight.shape
    assert phy2log.shape == (layers, slots)
    assert (logcnt >= 1).all(), "a logical expert has no replica"
    assert (logcnt.sum(-1) == slots).all()
    for layer in range(layers):
        counts = torch.bincount(phy2log[layer], minlength=experts)
        assert torch.equal(counts, logcnt[layer])
        for e in range(experts):
            phys = log2phy[layer, e]
            real = phys[phys >= 0]
            assert len(real) == int(logcnt[layer, e]), "log2phy and logcnt disagree"
            assert (phys[len(real) :] == -1).all(), "padding must follow the real slots"
            assert (phy2log[layer, real] == e).all(), "log2phy does not invert phy2log"


LOADS = {
    "zipf": lambda g, L, E: (1.0 / torch.arange(1, E + 1).double()).expand(L, E)[
        :, torch.randperm(E, generator=g)
    ],
    "one_hot_expert": lambda g, L, E: torch.ones(L, E).index_fill_(1, torch.tensor([3]), 500.0),
    "random_skewed": lambda g, L, E: torch.rand(L, E, generator=g) ** 4 * 1000,
    "uniform": lambda g, L, E: torch.full((L, E), 7.0),
}


@pytest.mark.parametrize("load", sorted(LOADS))
@pytest.mark.parametrize(
    ("experts", "slots", "groups", "nodes", "gpus"),
    [
        (16, 16, 4, 1, 2),
        (16, 20, 4, 2, 4),
        (64, 72, 8, 2, 8),
        (12, 16, 4, 2, 8),
        (32, 40, 3 + 1, 3, 4),
        (16, 24, 1, 1, 8),
    ],
)
def test_invariants_and_never_worse_than_identity(load, experts, slots, groups, nodes, gpus) -> None:
    """Every logical expert has a replica, the maps invert, every rank gets the same slot count (by
    construction of the slot ranges), and the balance is at least the identity placement's."""
    g = torch.Generator().manual_seed(experts * 7 + slots)
    weight = LOADS[load](g, 3, experts)
    phy2log, log2phy, logcnt = rebalance_experts(weight, slots, groups, nodes, gpus)
    _check_invariants(weight, slots, phy2log, log2phy, logcnt)
    if experts % gpus == 0:  # the identity placement exists: expert e in slot e, no replicas
        ident_p2l, _, ident_cnt = identity_placement(3, experts)
        ours = balancedness(weight, phy2log, logcnt, gpus)
        assert ours >= balancedness(weight, ident_p2l, ident_cnt, gpus) - 1e-12


def test_skewed_load_is_balanced_with_redundant_slots() -> None:
    """A hot expert gets replicas: balance rises well above the identity placement's."""
    weight = torch.ones(1, 16).index_fill_(1, torch.tensor([0, 1]), 40.0)
    ident_p2l, _, ident_cnt = identity_placement(1, 16)
    phy2log, _, logcnt = rebalance_experts(weight, 24, 4, 1, 2)
    before = balancedness(weight, ident_p2l, ident_cnt, 2)
    after = balancedness(weight, phy2log, logcnt, 2)
    assert before < 0.6 and after > 0.95, (before, after)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((16, 15, 4, 1, 2), "fewer than the 16"),
        ((16, 17, 4, 1, 2), "num_gpus=2"),
        ((16, 16, 5, 1, 2), "num_groups=5"),
    ],
)
def test_bad_sizes_are_clear_errors(args, message) -> None:
    experts, *rest = args
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(1, experts), *rest)
