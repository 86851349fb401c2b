"""Model quality on held-out stdlib code, measured through the engine: perplexity against a unigram
baseline, and whether completions of function signatures are valid Python."""

from __future__ import annotations

import ast
import math
import re
from collections import Counter

from deepinfer.bench.corpus import heldout_files
from deepinfer.bench.workload import heldout_stream
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

SIGNATURE = re.compile(r"^(\s*)(def [A-Za-z_]\w*\(.*\)(\s*->\s*[^:]+)?:)\s*$")


def heldout_slice(llm: LLM, windows: int, length: int) -> list[list[int]]:
    """``windows`` consecutive, non-overlapping windows of ``length`` tokens from the held-out stream."""
    stream = heldout_stream(llm.engine.tokenizer)
    if windows * length > len(stream):
        raise ValueError(f"the held-out stream has {len(stream)} tokens; asked for {windows} x {length}")
    return [stream[i * length : (i + 1) * length] for i in range(windows)]


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate(prompt_token_ids=windows, sampling_params=params)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            count += 1
    return math.exp(nll / count)


def unigram_perplexity(windows: list[list[int]], vocab_size: int) -> float:
    """Perplexity of the best unigram model of the same tokens (fitted on them, add-one smoothed):
    a baseline that knows the token frequencies and nothing else."""
    tokens = [t for w in windows for t in w[1:]]
    counts = Counter(tokens)
    total = len(tokens) + vocab_size
    nll = -sum(math.log((counts[t] + 1) / total) for t in tokens)
    return math.exp(nll / len(tokens))


def heldout_signatures(count: int) -> list[str]:
    """The first function signature of each held-out file (dedented), in path order, up to ``count``."""
    found = []
    for _, text in heldout_files():
        for line in text.splitlines():
            m = SIGNATURE.match(line)
            if m:
                found.append(m.group(2))
                break
        if len(found) == count:
            break
    return found


def body_parses(signature: str, completion: str) -> bool:
    """Whether the signature and the completion's first complete lines form a valid function: the
    signature's line, then the lines up to the first that dedents to its level (at least one)."""
    text = signature + completion
    lines = text.split("\n")
    complete = lines if text.endswith("\n") else lines[:-1]
    if len(complete) < 2:
        return False
    body = []
    for line in complete[1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            break
        body.append(line)
    while body and not body[-1].strip():
        body.pop()
    if not body:
        return False
    try:
        ast.parse("\n".join([complete[0], *body]) + "\n")
    except SyntaxError:
        return False
    return True


def signature_completions(
    llm: LLM, signatures: list[str], max_tokens: int = 96, repetition_penalty: float = 1.0
) -> list[tuple[str, str, bool]]:
    """Greedy completions of each signature (the prompt is the signature line itself, so the model
    writes the newline and indentation as it learned them): (signature, completion, parses)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=repetition_penalty)
    outs = llm.generate(signatures, params)
    return [(s, o.text, body_parses(s, o.text)) for s, o in zip(signatures, outs)]
