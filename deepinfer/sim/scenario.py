"""Published scenarios: the seed arithmetic, recomputed from its inputs beside each published value.

``deepseek-2026`` is the capacity and cost arithmetic published with DeepSeek's DeepInfer release
(October 2026) and the articles around it (``SPEC.md`` §3.3; sources: the deployment Q&A, AWS EC2
Capacity Blocks pricing, DeepSeek's API price page, Latent Space's revenue estimate). Every figure is
derived here from the stated inputs; nothing is copied from the outputs. Figures the inputs do not
reproduce are reported as such, with what they do give.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.platform.chips import sku_facts
from deepinfer.sim.costs import DEEPSEEK_V3, RooflineCost

SECONDS_PER_DAY = 86400


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    label: str
    value: float
    published: float | None
    unit: str
    formula: str

    @property
    def error(self) -> float | None:
        return None if self.published is None else self.value / self.published - 1


INPUTS_DEEPSEEK_2026: dict[str, tuple[float, str]] = {
    "decode_gpus": (64, "smallest efficient unit: 64 prefill + 64 decode GPUs (deployment Q&A)"),
    "prefill_gpus": (64, "same"),
    "decode_tokens_per_s_per_gpu": (15700, "EP64, 64 requests per rank (DeepSeek's decode benchmark)"),
    "balance": (0.8, "'roughly 80% of a perfectly balanced offline benchmark' (deployment Q&A)"),
    "gb200_usd_per_gpu_hour": (
        sku_facts("gb200").usd_per_chip_hour,
        "AWS EC2 Capacity Blocks, u-p6e-gb200x72",
    ),
    "b200_usd_per_gpu_hour": (
        sku_facts("b200").usd_per_chip_hour,
        "AWS EC2 Capacity Blocks, p6-b200.48xlarge",
    ),
    "revenue_usd_per_gpu_hour": (38.0, "'overall revenue of US$38 per GPU-hour (at valley pricing)'"),
    "revenue_usd_per_day": (22e6, "Latent Space's estimate from 155 T tokens/day at list prices"),
    "usd_per_m_input_uncached": (0.15, "DeepSeek API, off-peak"),
    "usd_per_m_input_cached": (0.003, "DeepSeek API, off-peak (50x less)"),
    "usd_per_m_output": (0.60, "DeepSeek API, off-peak; peak hours cost double"),
    "input_cache_hit_rate": (0.96, "96% of input tokens hit the cache"),
    "example_output_tokens_per_day": (500e6, "the article's default self-hosting volume"),
    "example_input_tokens_per_day": (3e9, "same"),
    "cache_tb_per_online_gpu": (14.4, "'about 14.4 TB per GPU' of logical cache"),
    "ssd_tb_per_storage_server": (20 * 30.73, "20 x 30.73 TB SSDs per KV cache storage server"),
    "store_pib": (100, "~100 PiB of SSD in 3FS for the KV cache"),
    "ttl_agent_days": (3, "TTL for agent traffic"),
    "ttl_chat_days": (7, "TTL for chat traffic"),
}


def deepseek_2026(v: dict[str, float]) -> list[Figure]:
    """The figures derived from the inputs ``v`` (INPUTS_DEEPSEEK_2026's values)."""
    gpus = v["decode_gpus"] + v["prefill_gpus"]
    ceiling = v["decode_gpus"] * v["decode_tokens_per_s_per_gpu"] * SECONDS_PER_DAY
    rental = gpus * v["gb200_usd_per_gpu_hour"] * 24
    published_api_cost = 680.0  # the article's figure for the example volume
    hit = v["input_cache_hit_rate"]
    input_price = hit * v["usd_per_m_input_cached"] + (1 - hit) * v["usd_per_m_input_uncached"]
    kv_bytes = DEEPSEEK_V3.kv_bytes_per_token
    check = RooflineCost(sku_facts("gb200"), ep=64)
    step = check.step_seconds([[(1, 4096)] * 128])  # 64 requests x (1 token + 1 MTP draft), 4k context
    figures = [
        Figure("output_tokens_per_day_ceiling", "decode ceiling", ceiling, 87e9, "tokens/day",
               "decode_gpus x decode_tokens_per_s_per_gpu x 86,400"),
        Figure("output_tokens_per_day_balanced", "at the published balance", ceiling * v["balance"], 69e9,
               "tokens/day", "ceiling x balance"),
        Figure("cluster_rental_usd_per_day", "64P + 64D GB200 rental", rental, 32508, "US$/day",
               "(prefill_gpus + decode_gpus) x gb200_usd_per_gpu_hour x 24"),
        Figure("revenue_to_rental_b200", "revenue / B200 rental", v["revenue_usd_per_gpu_hour"] / v["b200_usd_per_gpu_hour"],
               2.7, "x", "revenue_usd_per_gpu_hour / b200_usd_per_gpu_hour"),
        Figure("revenue_to_rental_gb200", "revenue / GB200 rental", v["revenue_usd_per_gpu_hour"] / v["gb200_usd_per_gpu_hour"],
               3.6, "x", "revenue_usd_per_gpu_hour / gb200_usd_per_gpu_hour"),
        Figure("api_output_tokens_for_rental_offpeak", "API output tokens the rental buys (off-peak)",
               rental / v["usd_per_m_output"] * 1e6, 54.2e9, "tokens/day", "rental / usd_per_m_output"),
        Figure("api_output_tokens_for_rental_peak", "same at peak (double price)",
               rental / (2 * v["usd_per_m_output"]) * 1e6, 27e9, "tokens/day", "rental / (2 x usd_per_m_output)"),
        Figure("example_api_usd_per_day_uncached", "example volume on the API, no cache hits",
               (v["example_output_tokens_per_day"] * v["usd_per_m_output"]
                + v["example_input_tokens_per_day"] * v["usd_per_m_input_uncached"]) / 1e6,
               published_api_cost, "US$/day", "output x 0.60 + input x 0.15 (per M); the published US$680 "
               "lies between this and the cached figure below, so its hit-rate assumption is not stated"),
        Figure("example_api_usd_per_day_at_hit_rate", "example volume on the API at the 96% hit rate",
               (v["example_output_tokens_per_day"] * v["usd_per_m_output"]
                + v["example_input_tokens_per_day"] * input_price) / 1e6,
               None, "US$/day", "output x 0.60 + input x (0.96 x 0.003 + 0.04 x 0.15) (per M)"),
        Figure("traffic_multiple_to_break_even", "traffic multiple at which the cluster wins",
               rental / published_api_cost, 48, "x", "rental / the published US$680 API cost"),
        Figure("implied_online_gpus", "accelerators implied by the revenue figures",
               v["revenue_usd_per_day"] / (24 * v["revenue_usd_per_gpu_hour"]), None, "GPUs",
               "revenue_usd_per_day / (24 x revenue_usd_per_gpu_hour)"),
        Figure("cache_tb_for_unit", "logical KV cache for the 128-GPU unit", gpus * v["cache_tb_per_online_gpu"], None,
               "TB", "gpus x cache_tb_per_online_gpu"),
        Figure("storage_servers_for_unit", "storage servers for it", gpus * v["cache_tb_per_online_gpu"]
               / v["ssd_tb_per_storage_server"], None, "servers", "cache_tb_for_unit / ssd_tb_per_storage_server"),
        Figure("online_gpus_for_store", "online GPUs the 100 PiB store serves at 14.4 TB each",
               v["store_pib"] * 2**50 / 1e12 / v["cache_tb_per_online_gpu"], None, "GPUs",
               "store_pib / cache_tb_per_online_gpu"),
        Figure("cached_tokens_per_gpu", "DeepSeek-V3 KV tokens in 14.4 TB (bf16 576-wide latent, 61 layers)",
               v["cache_tb_per_online_gpu"] * 1e12 / kv_bytes, None, "tokens", "14.4 TB / 70,272 bytes per token"),
        Figure("roofline_decode_tokens_per_s_per_gpu", "cross-check: our GB200 roofline, DeepSeek-V3, EP64, "
               "64 requests/rank, 4k context, 1 MTP draft fully accepted", 128 / step, 15700, "tokens/s/GPU",
               "RooflineCost(gb200, ep=64): a different model (V3, not V4.1-Flash) and an assumed context"),
    ]  # fmt: skip
    return figures


SCENARIOS = {"deepseek-2026": (INPUTS_DEEPSEEK_2026, deepseek_2026)}


def run_scenario(name: str) -> dict:
    """The scenario as one JSON-ready object: inputs (with sources) and figures."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    inputs, derive = SCENARIOS[name]
    figures = derive({k: value for k, (value, _) in inputs.items()})
    out: dict = {
        "scenario": name,
        "inputs": {k: {"value": value, "source": src} for k, (value, src) in inputs.items()},
        "figures": [
            {"key": f.key, "label": f.label, "value": f.value, "published": f.published, "unit": f.unit,
             "error": f.error, "formula": f.formula}
            for f in figures
        ],
    }  # fmt: skip
    out.update({f.key: f.value for f in figures})
    return out


def format_scenario(result: dict) -> str:
    lines = [f"scenario {result['scenario']}", "", "inputs:"]
    for key, item in result["inputs"].items():
        lines.append(f"  {key:32s} {item['value']:>14,.4g}   {item['source']}")
    lines += ["", f"  {'figure':44s} {'ours':>16s} {'published':>12s} {'error':>7s}  unit"]
    for f in result["figures"]:
        published = f"{f['published']:,.4g}" if f["published"] is not None else "-"
        error = f"{f['error']:+.1%}" if f["error"] is not None else ""
        lines.append(
            f"  {f['label'][:44]:44s} {f['value']:>16,.4g} {published:>12s} {error:>7s}  {f['unit']}"
        )
    lines += ["", "formulas:"] + [f"  {f['key']}: {f['formula']}" for f in result["figures"]]
    return "\n".join(lines)
