"""The needle harness: a few needle requests, run alone and among random batch mates under different
engine settings; what each needle emits (tokens and the logprob of every generated token)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from deepinfer import LLM, SamplingParams

MAX_TOKENS = 6


@dataclass(frozen=True, slots=True)
class Setting:
    """Engine settings of one run: prompt chunk size (None: whole prompts), prefix caching, MTP."""

    chunk: int | None
    prefix_cache: bool
    speculative: bool

    def label(self) -> str:
        return (
            f"chunk={self.chunk or 'whole'},prefix_cache={'on' if self.prefix_cache else 'off'},"
            f"spec={'on' if self.speculative else 'off'}"
        )


# Every setting of the acceptance list appears: chunks 16 / 64 / whole, prefix cold / warm (with the
# cache on, the needles' prompts are cached after their first run), speculation on / off.
SETTINGS = [
    Setting(None, False, False),
    Setting(16, False, False),
    Setting(64, True, False),
    Setting(None, True, True),
    Setting(16, True, True),
]
MATES = (0, 1, 7, 31)


def needle_requests(vocab: int, seed: int = 7) -> list[tuple[list[int], SamplingParams]]:
    """Two needles: one greedy, one sampled at temperature 0.8 with its own seed; prompts long enough
    to be cut by 16- and 64-token chunks and to fill prefix-cache blocks."""
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(temperature=0.8, seed=4242, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    return [
        ([rng.randrange(2, vocab) for _ in range(75)], greedy),
        ([rng.randrange(2, vocab) for _ in range(41)], sampled),
    ]


def batch_mates(count: int, vocab: int, rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Random prompts of random lengths, random output lengths, greedy or sampled."""
    mates = []
    for _ in range(count):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 48))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randrange(1 << 30),
            max_tokens=rng.randint(1, 6),
            ignore_eos=True,
        )
        mates.append((prompt, params))
    return mates


Emitted = tuple[tuple[int, ...], tuple[float, ...]]


def emitted(out) -> Emitted:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs))


def run_needles(
    model: Path, deterministic: bool, vocab: int, seed: int = 0
) -> dict[tuple[str, int, int], Emitted]:
    """(setting label, mates, needle index) -> what the needle emitted. With no mates each needle runs
    alone; otherwise both needles run at random positions among ``mates`` random requests."""
    rng = random.Random(seed)
    needles = needle_requests(vocab)
    results: dict[tuple[str, int, int], Emitted] = {}
    for setting in SETTINGS:
        options = dict(
            num_kv_blocks=400,
            enable_prefix_caching=setting.prefix_cache,
            long_prefill_token_threshold=setting.chunk,
            deterministic=deterministic,
        )
        if setting.speculative:
            options.update(speculative="mtp", num_draft_tokens=2)
        llm = LLM(str(model), **{k: v for k, v in options.items() if v is not None})
        for count in MATES:
            if count == 0:
                for i, (prompt, params) in enumerate(needles):
                    out = llm.generate(prompt_token_ids=[prompt], sampling_params=[params])[0]
                    results[(setting.label(), 0, i)] = emitted(out)
                continue
            batch = batch_mates(count, vocab, rng)
            spots = sorted(rng.sample(range(count + 2), 2))
            for spot, needle in zip(spots, needles):
                batch.insert(spot, needle)
            outs = llm.generate(prompt_token_ids=[p for p, _ in batch], sampling_params=[s for _, s in batch])
            for i, spot in enumerate(spots):
                results[(setting.label(), count, i)] = emitted(outs[spot])
    return results


def differences(results: dict[tuple[str, int, int], Emitted]) -> list[str]:
    """Cases whose needle output differs, bit for bit, from the needle alone in the first setting."""
    base = SETTINGS[0].label()
    out = []
    for (label, count, i), value in results.items():
        reference = results[(base, 0, i)]
        if value != reference:
            tokens_same = value[0] == reference[0]
            out.append(
                f"needle {i} with {label}, {count} mates: "
                + ("same tokens, different logprob bits" if tokens_same else "different tokens")
            )
    return out
