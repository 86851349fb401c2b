"""The validation's fits, on synthetic step logs whose true costs are known (the real runs against a
served engine are in test_slow.py), and the simulator's handoff as our router makes it."""

import re

import pytest

from deepinfer.bench.serve import RequestResult
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.router.config import RouterConfig
from deepinfer.sim.cluster import ClusterConfig, EngineKnobs, PoolConfig, Simulation
from deepinfer.sim.costs import CalibratedCost
from deepinfer.sim.validation import (
    RESIDUAL_MIN_STEPS,
    CoreLog,
    Served,
    batch_residuals,
    fit_front,
    fit_served_steps,
)
from deepinfer.sim.workload import Arrival, Segment

TRUE = StepCostModel(5e-3, 4e-4, 6e-5, 2e-8, 3e-6, "truth")
GAP_S = 2e-3  # the core loop between two steps


def synthetic_log() -> tuple[CoreLog, Served]:
    """Four requests, each arriving to an idle core: a 200-token prompt, then 9 decodes, then idle.
    The runner takes TRUE's time, the step 0.5 ms more, the loop GAP_S; the front takes 10 ms in
    and 5 ms out."""
    adds, steps, sends, results, t = {}, [], [], [], 0.0
    for i in range(4):
        rid, send = f"c{i}", t
        adds[rid] = {"t": send + 0.010, "prompt": 200}
        t = send + 0.010
        first_end = None
        for k in range(10):
            work = [(200, 0)] if k == 0 else [(1, 200 + k - 1)]
            forward = TRUE.predict(work)
            t1 = t + forward + 5e-4
            steps.append({"t0": t, "t1": t1, "forward_s": forward, "work": work, "ids": [rid],
                          "first": [rid] if k == 0 else []})  # fmt: skip
            first_end = first_end or t1
            t = t1 + GAP_S
        ttft = first_end + 0.005 - send
        sends.append(send)
        results.append(RequestResult(ttft_s=ttft, token_times=[ttft], end_s=t - send))
        t += 1.0  # idle until the next one
    return CoreLog(adds, steps), Served([[0] * 200] * 4, sends, results, ((0.0,), (0.0,)))


def test_the_served_step_fits_recover_the_true_costs() -> None:
    log, _ = synthetic_log()
    period, runner, summary = fit_served_steps(log)
    assert summary["median_loop_gap_s"] == pytest.approx(GAP_S)
    for work in ([(200, 0)], [(1, 205)]):
        assert runner.predict(work) == pytest.approx(TRUE.predict(work), rel=0.02)
        assert period.predict(work) == pytest.approx(TRUE.predict(work) + 5e-4 + GAP_S, rel=0.02)


def test_the_front_latency_is_measured_in_and_out() -> None:
    log, served = synthetic_log()
    front = fit_front(served, log, log)
    assert front["admission_delay_s"] == pytest.approx(0.010)
    assert front["delivery_delay_s"] == pytest.approx(0.005)
    assert front["idle_arrivals"] == 4


def test_the_simulated_handoff_follows_our_router() -> None:
    # first_token_from="decode": the prefill hop's token is not the client's; the decode rank gets
    # the prompt's full blocks before its last token, computes the rest, samples every output token.
    cost = CalibratedCost(StepCostModel(2e-3, 1e-4, 3e-5, 1e-8, 1e-6, "test"))
    knobs = EngineKnobs(num_blocks=1000, block_size=16)
    config = ClusterConfig(
        [PoolConfig("prefill", 1, 1, cost, knobs), PoolConfig("decode", 1, 1, cost, knobs)],
        router=RouterConfig(min_disaggregated_tokens=0), first_token_from="decode",
        kv_transfer_latency_s=0.25, kv_transfer_bytes_per_s=float("inf"),
    )  # fmt: skip
    sim = Simulation(config)
    sim.run([Arrival(0.0, "r", "code", (Segment(("p",), 100),), 8)], until=100)
    trace = sim.traces["r"]
    (prefill,) = sim.pools["prefill"][0].ranks
    (decode,) = sim.pools["decode"][0].ranks
    assert prefill.tokens_done == 100
    assert decode.tokens_done == (100 - 96) + 7  # the tail after 6 full blocks, then 7 decodes
    assert len(trace.token_times) == 8 and trace.first_token_s > 0.25


def test_a_wait_for_a_kv_load_is_no_steps_period() -> None:
    """A decode worker: c1 is added while c0 decodes, but runs only after c0 has finished and its KV
    has loaded (0.2 s idle). That wait must not count as the period of c0's last step."""
    adds = {"c0": {"t": 0.0, "prompt": 200}, "c1": {"t": 0.005, "prompt": 200}}
    steps, t = [], 0.0
    for rid, n in (("c0", 30), ("c1", 30)):
        for k in range(n):
            work = [(1, 200 + k)]
            forward = TRUE.predict(work)
            steps.append({"t0": t, "t1": t + forward, "forward_s": forward, "work": work, "ids": [rid],
                          "first": [rid] if k == 0 else []})  # fmt: skip
            t += forward + GAP_S
        t += 0.2  # c1's KV loads while the core has nothing to run
    period, _, summary = fit_served_steps(CoreLog(adds, steps))
    assert summary["median_loop_gap_s"] == pytest.approx(GAP_S)
    assert period.predict([(1, 215)]) == pytest.approx(TRUE.predict([(1, 215)]) + GAP_S, rel=0.02)


def test_requests_sent_close_together_are_matched_by_prompt_length() -> None:
    """Two requests sent 1 ms apart may reach the core in either order: each add goes to the
    earliest-sent unmatched request of its prompt's length; a length the trace lacks is an error."""
    prompts = [[0] * 300, [0] * 200, [0] * 300]
    served = Served(prompts, [0.0, 0.001, 0.002], [RequestResult()] * 3, ((0.0,), (0.0,)))
    adds = {
        "a": {"t": 0.010, "prompt": 200},
        "b": {"t": 0.011, "prompt": 300},
        "c": {"t": 0.012, "prompt": 300},
    }
    assert CoreLog(adds, []).in_send_order(served) == ["b", "a", "c"]
    adds["c"]["prompt"] = 100
    with pytest.raises(
        RuntimeError, match=re.escape("core request c (100 prompt tokens) matches no request")
    ):
        CoreLog(adds, []).in_send_order(served)


def test_host_contention_with_a_peer_core_is_fitted_apart_from_the_step_costs() -> None:
    """Decode steps that start while the peer core (the other worker on the host) is in a step take
    1.5x: the fit finds contention 0.5 and the uncontended costs; without the peer it cannot."""
    steps, peer_steps, t = [], [], 0.0
    for k in range(200):
        work = [(1, 200 + k)] * (1 + k % 3)
        shared = k % 4 == 0
        if shared:
            peer_steps.append({"t0": t - 1e-3, "t1": t + 1e-3, "forward_s": 2e-3, "work": [(500, 0)],
                               "ids": [f"p{k}"], "first": []})  # fmt: skip
        forward = TRUE.predict(work) * (1.5 if shared else 1.0)
        steps.append({"t0": t, "t1": t + forward, "forward_s": forward, "work": work, "ids": ["c0", "c1", "c2"][: len(work)],
                      "first": []})  # fmt: skip
        t += forward + GAP_S
    log, peer = CoreLog({}, steps), CoreLog({}, peer_steps)
    period, runner, summary = fit_served_steps(log, peer)
    assert summary["contention"] == pytest.approx(0.5, rel=0.02)
    assert summary["steps_sharing_the_host"] == 50
    assert runner.predict([(1, 300)] * 2) == pytest.approx(TRUE.predict([(1, 300)] * 2), rel=0.02)
    assert period.predict([(1, 300)]) == pytest.approx(TRUE.predict([(1, 300)]) + GAP_S, rel=0.05)
    assert fit_served_steps(log)[2]["contention"] == 0.0


SERVED = StepCostModel(8e-3, 3.5e-3, 1.5e-4, 0.0, 1e-5, "served")


def concave(work: list[tuple[int, int]]) -> float:
    """A served step whose per-request cost stops growing at 3 requests (as on this host)."""
    return SERVED.predict(work[:3]) + SERVED.per_token_s * sum(n for n, _ in work[3:])


def test_batch_residuals_put_each_batch_size_back_on_its_mean() -> None:
    """Decode steps of 1-6 requests with a per-request cost that saturates at 3: a line fitted
    through them misses each size; the residuals are each size's mean miss; a size seen too seldom
    takes the one below it, and the simulated clock (CalibratedCost.period) adds them."""
    works = [[(1, 300)] * b for b in range(1, 7) for _ in range(RESIDUAL_MIN_STEPS)]
    works += [[(1, 300)] * 7] * (RESIDUAL_MIN_STEPS - 1)  # too few of 7: takes 6's residual
    periods = [concave(w) for w in works]
    line = StepCostModel.fit_mean(list(zip(works, periods)), "line")
    residual = batch_residuals(works, periods, line)
    assert len(residual) == 7 and residual[6] == residual[5]
    cost = CalibratedCost(line, line, batch_residual_s=residual)
    for b in range(1, 7):
        work = [(1, 300)] * b
        assert cost.period(work) == pytest.approx(concave(work), rel=1e-6)
    assert abs(line.predict([(1, 300)] * 6) / concave([(1, 300)] * 6) - 1) > 0.05  # the line alone misses
    # A prompt chunk among 5 decodes gets the residual of 6 requests; past the table, the last entry.
    mixed = [(200, 100)] + [(1, 300)] * 5
    assert cost.period(mixed) == pytest.approx(line.predict(mixed) + residual[5])
    assert cost.step_seconds([[(1, 300)] * 9]) == pytest.approx(line.predict([(1, 300)] * 9) + residual[6])
    assert batch_residuals([[(50, 0)]] * 30, [0.1] * 30, line) == ()  # no decode-only step: no table


def test_measured_tpot_is_per_output_token_whatever_the_events() -> None:
    """A front that falls behind sends two tokens in one SSE event: the measured TPOT stays per
    output token (the simulator's definition); the per-event figure is kept apart."""
    tokens_at = [0.1 + 0.02 * k for k in range(9)]  # 9 tokens, 20 ms apart
    merged = [tokens_at[0], *tokens_at[2::2]]  # events carrying tokens 2+3, 4+5, ...
    results = [RequestResult(ttft_s=0.1, token_times=merged, end_s=tokens_at[-1], output_tokens=9)]
    figures = Served([[0] * 10], [0.0], results, ((0.0,), (0.0,))).figures()
    assert figures["tpot_p50"] == pytest.approx(0.02)
    assert figures["tpot_per_event_p50"] == pytest.approx(0.16 / 4)
