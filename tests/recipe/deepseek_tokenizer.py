"""A small byte-level BPE tokenizer with DeepSeek-V3.1's full control-token set, written to a folder
the way a model ships it (tokenizer.json + tokenizer_config.json).

Like DeepSeek's own, BOS/EOS/User/Assistant/pad are special added tokens while ``<think>``,
``</think>`` and the tool markers are added as *non-special* tokens: the recipe must keep user text
from producing either kind.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.recipe import tokens as T

SPECIAL = [T.BOS, T.EOS, T.USER, T.ASSISTANT, "<｜▁pad▁｜>"]
NON_SPECIAL = [
    T.THINK_BEGIN,
    T.THINK_END,
    T.TOOL_CALLS_BEGIN,
    T.TOOL_CALLS_END,
    T.TOOL_CALL_BEGIN,
    T.TOOL_CALL_END,
    T.TOOL_SEP,
    T.TOOL_OUTPUT_BEGIN,
    T.TOOL_OUTPUT_END,
]
CONTROL_TEXTS = SPECIAL + NON_SPECIAL
CORPUS = [
    "You are a helpful assistant. Who are you? I am DeepSeek, an AI assistant.\n",
    "What is the weather in Paris today? It is sunny and 21 degrees.\n",
    '{"location": "Paris", "unit": "celsius"} {"city": "Tokyo", "days": 3}\n',
    "## Tools\nYou have access to the following tools:\n\n### get_weather\nDescription: Get the weather\n",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, 'héllo wörld ✓ 日本語 🙂')\n",
    "Let me think step by step. First, 1 + 1 = 2. So the answer is 2.\n",
] * 20


def write_deepseek_tokenizer(path: Path, vocab_size: int = 512) -> int:
    """Train the tokenizer into ``path``; returns its vocabulary size (added tokens included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": T.BOS, "eos_token": T.EOS, "pad_token": "<｜▁pad▁｜>", "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()
