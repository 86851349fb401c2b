"""Train "deepinfer-tiny-coder", a tiny DeepSeek-V3-architecture model, on the Python standard library.

The script is self-contained and deterministic for a fixed ``--seed`` and ``--steps`` (on the same software
stack and thread count). It

1. collects the ``.py`` files of the running interpreter's standard library (``sysconfig`` "stdlib"), drops
   unsuitable ones (see ``EXCLUDED_PREFIXES`` and ``collect_corpus``) and splits the rest into train and
   validation by a SHA-256 hash of the relative path (3 % validation);
2. trains a byte-level BPE tokenizer (8192 entries including the 16 DeepSeek-V3 special tokens) on the
   train split and checks that decoding round-trips every corpus file and some non-ASCII strings;
3. trains a ``transformers`` ``DeepseekV3ForCausalLM`` (MLA, one dense layer, then DeepSeekMoE layers with a
   shared expert and group-limited ``noaux_tc`` sigmoid routing) together with one multi-token-prediction
   (MTP) module, updating every router's ``e_score_correction_bias`` with DeepSeek-V3's aux-loss-free rule;
4. evaluates the main model and the MTP module on a fixed validation slice against a unigram baseline;
5. writes a Hugging Face model folder (config, float32 safetensors including the MTP tensors under
   DeepSeek's ``model.layers.N.*`` names, tokenizer, generation config, ``training_report.json`` and a
   ``README.md`` model card) and verifies that it reloads with identical logits.

Usage::

    python tools/train_tiny.py --out /tmp/tiny --quick          # ~2 minute smoke run
    python tools/train_tiny.py --out /tmp/tiny --steps 1400     # full run (deterministic)
    python tools/train_tiny.py --out /tmp/tiny --minutes 45     # full run, step count from measured speed

Without ``--steps`` the step count is derived from the speed of the first steps, so it depends on the
machine; pass ``--steps`` for a reproducible run. ``--minutes`` also acts as a wall-clock guard on the
training loop: if it runs out, training stops early and the report says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

from deepinfer.bench.corpus import (
    EXCLUDED_PREFIXES,
    VALIDATION_PER_MILLE,
    exclusion_reason,
    path_hash,
    read_source,
)
from deepinfer.model.layouts import fused_name, to_fused_layout, to_published_layout

MODEL_NAME = "deepinfer-tiny-coder"
# Raising glibc's mmap/trim thresholds keeps freed activation buffers in the heap; without it every training
# step page-faults its activations afresh, which roughly halves throughput on the 2-core development machine.
GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"
# libgomp's default busy-wait (300k spins) makes a thread that shares its core with another process stall its
# partner at every OpenMP barrier; on the shared 2-core machine 20k spins measured 1.2-3.1 s/step against
# 2.9-8.3 s/step for the default under the same background load. Only set when the caller has not.
GOMP_SPINCOUNT = "20000"
NUM_THREADS = 2

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
# Order fixes the ids: BOS = 0 and EOS = 1, as in DeepSeek-V3 and DeepseekV3Config's defaults.
SPECIAL_TOKENS = [
    BOS,
    EOS,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    PAD,
]
VOCAB_SIZE = 8192
MAX_POSITION_EMBEDDINGS = 8192

# Corpus selection (the rules live in deepinfer.bench.corpus, shared with the benchmarks).
QUICK_TRAIN_FRACTION = 8  # --quick trains on 1/8 of the train files

# Optimisation.
PEAK_LR = 2e-3
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3 used 0.3 for the first 10T tokens
BIAS_UPDATE_SPEED = 1e-3  # gamma of the aux-loss-free balancing rule
CALIBRATION_STEPS = 12  # steps timed to pick the step count when --steps is absent
LOG_EVERY = 10
FP32_CHECKPOINT_LIMIT_BYTES = 40 * 1024 * 1024

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system_prompt = ns.system_prompt + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system_prompt -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<｜User｜>' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
    "{{- message['content'] or '' -}}"
    "{%- if message.get('tool_calls') -%}"
    "{{- '<｜tool▁calls▁begin｜>' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{%- if arguments is not string -%}{%- set arguments = arguments | tojson -%}{%- endif -%}"
    "{{- '<｜tool▁call▁begin｜>' + call.get('type', 'function') + '<｜tool▁sep｜>' + call['function']['name']"
    " + '\\n```json\\n' + arguments + '\\n```<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜>' -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- endif -%}"
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and (not messages or messages[-1]['role'] != 'tool') -%}"
    "{{- '<｜Assistant｜>' -}}"
    "{%- endif -%}"
)

ROUND_TRIP_SAMPLES = [
    "",
    "print('héllo, wörld')  # naïve café",
    "日本語のコメント = '中文' + 'Ελληνικά' + 'русский'",
    "emoji = '🐍🚀' + '\\u2581' + '｜'\r\n\ttab\x00nul\x7f",
    "mixed <｜User｜> text with <think>special</think> strings<｜end▁of▁sentence｜>",
    "    \n\n\t  trailing whitespace   \n",
]


@dataclass
class Corpus:
    """The stdlib corpus split into train and validation documents (relative path, text)."""

    root: Path
    train: list[tuple[str, str]]
    val: list[tuple[str, str]]
    excluded: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class RunSettings:
    """Resolved command-line settings for one run."""

    out: Path
    minutes: float
    steps: int | None
    seq_len: int
    batch_size: int
    seed: int
    quick: bool
    val_tokens: int
    warmup_steps: int


def ensure_runtime_environment() -> None:
    """Re-execute with ``GLIBC_TUNABLES`` (and ``GOMP_SPINCOUNT``) set: both are read at process start-up."""
    if os.environ.get("GLIBC_TUNABLES") == GLIBC_TUNABLES and "GOMP_SPINCOUNT" in os.environ:
        return
    env = {**os.environ, "GLIBC_TUNABLES": GLIBC_TUNABLES}
    env.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def parse_args(argv: list[str] | None = None) -> RunSettings:
    """Parse the command line; ``--quick`` changes the defaults of the size-related options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/deepinfer-tiny-coder"), help="output folder")
    parser.add_argument("--minutes", type=float, default=None, help="training-loop wall-clock budget")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: fit --minutes)")
    parser.add_argument("--seq-len", type=int, default=None, help="training sequence length (default 512)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="~2 minute smoke configuration")
    args = parser.parse_args(argv)
    quick = args.quick
    return RunSettings(
        out=args.out,
        minutes=args.minutes if args.minutes is not None else (10.0 if quick else 45.0),
        steps=args.steps if args.steps is not None else (30 if quick else None),
        seq_len=args.seq_len or (128 if quick else 512),
        batch_size=args.batch_size or (4 if quick else 8),
        seed=args.seed,
        quick=quick,
        val_tokens=8_192 if quick else 200_000,
        warmup_steps=5 if quick else 100,
    )


def collect_corpus(root: Path, quick: bool) -> Corpus:
    """Read the stdlib ``.py`` files, apply the exclusions and split by path hash.

    Exclusions: the directories in ``EXCLUDED_PREFIXES``, the charmap codec tables generated by gencodec.py,
    and any remaining file that is not UTF-8 or does not parse with this interpreter (deliberately broken
    test fixtures; Lib/test/test_source_encoding.py, which embeds Latin-1 bytes, is the only one today).
    """
    corpus = Corpus(root=root, train=[], val=[])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        text = None if relative.startswith(tuple(EXCLUDED_PREFIXES)) else read_source(path)
        reason = exclusion_reason(relative, text)
        if reason is not None:
            corpus.excluded.setdefault(reason, []).append(relative)
            continue
        digest = path_hash(relative)
        if digest % 1000 < VALIDATION_PER_MILLE:
            corpus.val.append((relative, text))
        elif not quick or (digest >> 32) % QUICK_TRAIN_FRACTION == 0:
            corpus.train.append((relative, text))
    return corpus


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose first ids are ``SPECIAL_TOKENS`` and which prepends BOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """Encode texts (no special tokens) and concatenate them as ``BOS + text + EOS`` documents."""
    encoded = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    stream = [token for ids in encoded for token in (bos, *ids, eos)]
    return encoded, torch.tensor(stream, dtype=torch.long)


def check_round_trip(tokenizer: Tokenizer, texts: list[str], encoded: list[list[int]]) -> dict[str, int]:
    """Check ``decode(encode(s)) == s`` for every corpus text and the non-ASCII samples; raise on failure."""
    decoded = tokenizer.decode_batch(encoded, skip_special_tokens=False)
    failures = sum(text != back for text, back in zip(texts, decoded))
    for sample in ROUND_TRIP_SAMPLES:
        ids = tokenizer.encode(sample, add_special_tokens=False).ids
        failures += tokenizer.decode(ids, skip_special_tokens=False) != sample
    if failures:
        raise RuntimeError(f"tokenizer round trip failed for {failures} texts")
    with_specials = sum(any(s in text for s in SPECIAL_TOKENS) for text in texts)
    return {
        "corpus_files_checked": len(texts),
        "extra_samples_checked": len(ROUND_TRIP_SAMPLES),
        "corpus_files_containing_special_token_strings": with_specials,
    }


def build_config(vocab_size: int) -> DeepseekV3Config:
    """The deepinfer-tiny-coder architecture: DeepSeek-V3's shape at a tiny scale."""
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=512,  # the dense layer's MLP
        moe_intermediate_size=64,  # each routed and the shared expert
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        num_nextn_predict_layers=1,
        # Not read by transformers 5 (its router is always sigmoid + noaux_tc) but part of DeepSeek-V3's
        # published config and read by other engines.
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        architectures=["DeepseekV3ForCausalLM"],
    )


class MultiTokenPredictor(nn.Module):
    """DeepSeek-V3's multi-token-prediction module of depth 1.

    Given the main model's final-normed hidden state ``h_i`` and token ``t_{i+1}`` it computes
    ``x = eh_proj(cat([enorm(Emb(t_{i+1})), hnorm(h_i)]))``, runs one causal ``DeepseekV3DecoderLayer``
    (``layer_idx = num_hidden_layers``, so an MoE layer) with the main model's rotary embedding and returns
    ``shared_head.head(shared_head.norm(.))``, logits for ``t_{i+2}``. Position ``i`` uses rotary position
    ``i``; attention scores only depend on position differences, so engines that number the MTP sequence from
    ``i + 1`` instead compute the same function.

    During training ``embed_tokens`` and ``shared_head.head`` are the main model's modules (shared, as in
    DeepSeek-V3); ``checkpoint_tensors`` saves them as separate copies under DeepSeek's names.
    """

    def __init__(self, config: DeepseekV3Config, embed_tokens: nn.Embedding, head: nn.Linear) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = embed_tokens
        self.enorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = nn.ModuleDict(
            {"norm": DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps), "head": head}
        )

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, rotary_emb: nn.Module) -> torch.Tensor:
        """Logits for ``t_{i+2}`` from ``h_i`` (``hidden``, [B, T, H]) and ``t_{i+1}`` (``next_ids``, [B, T])."""
        x = torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1)
        x = self.eh_proj(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.block.self_attn.config,
            inputs_embeds=x,
            attention_mask=None,
            cache=None,
            position_ids=position_ids,
        )
        x = self.block(
            x, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary_emb(x, position_ids)
        )
        return self.shared_head["head"](self.shared_head["norm"](x))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The module's tensors under DeepSeek's names relative to ``model.layers.N.`` (copies, contiguous)."""
        return {
            name.removeprefix("block."): tensor.detach().clone().contiguous()
            for name, tensor in self.state_dict().items()
        }

    @staticmethod
    def module_name(checkpoint_name: str) -> str:
        """Inverse of ``checkpoint_tensors``' renaming: the decoder layer's tensors live under ``block.``."""
        own = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
        return checkpoint_name if checkpoint_name.startswith(own) else f"block.{checkpoint_name}"


class RouterLoadTracker:
    """Counts the tokens routed to each expert of a set of routers (forward hooks on ``mlp.gate``)."""

    def __init__(self, routers: dict[str, DeepseekV3TopkRouter]) -> None:
        self.routers = routers
        self.counts = {name: torch.zeros(r.num_experts, dtype=torch.long) for name, r in routers.items()}
        for name, router in routers.items():
            router.register_forward_hook(self._make_hook(name))

    def _make_hook(self, name: str) -> Callable[[nn.Module, tuple, tuple], None]:
        def hook(_module: nn.Module, _inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
            topk_indices = output[2]
            self.counts[name] += torch.bincount(topk_indices.flatten(), minlength=self.counts[name].numel())

        return hook

    def reset(self) -> None:
        """Forget the counts."""
        for counts in self.counts.values():
            counts.zero_()

    @torch.no_grad()
    def update_biases(self, gamma: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing: ``bias_e += gamma * sign(mean_load - load_e)``."""
        for name, router in self.routers.items():
            load = self.counts[name].float()
            router.e_score_correction_bias += gamma * torch.sign(load.mean() - load)

    def max_over_mean(self) -> dict[str, float]:
        """Per router, the busiest expert's load divided by the mean load (1.0 = perfectly balanced)."""
        return {name: (c.max() / c.float().mean()).item() for name, c in self.counts.items()}


def parameter_counts(model: DeepseekV3ForCausalLM, mtp: MultiTokenPredictor) -> dict[str, int]:
    """Total and per-token active parameter counts of the main model and of the MTP module."""
    config = model.config
    embedding = model.model.embed_tokens.weight.numel()
    lm_head = model.lm_head.weight.numel()
    main_total = sum(p.numel() for p in model.parameters())
    experts = mtp.block.mlp.experts
    per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // config.n_routed_experts
    inactive_per_moe_layer = (config.n_routed_experts - config.num_experts_per_tok) * per_expert
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    shared = {id(p) for p in model.parameters()}
    mtp_own = sum(p.numel() for p in mtp.parameters() if id(p) not in shared)
    return {
        "main_total": main_total,
        "main_embedding": embedding,
        "main_lm_head": lm_head,
        "main_non_embedding": main_total - embedding - lm_head,
        "main_active_per_token": main_total - moe_layers * inactive_per_moe_layer,
        "main_active_per_token_non_embedding": main_total
        - embedding
        - lm_head
        - moe_layers * inactive_per_moe_layer,
        "routed_expert_size": per_expert,
        "mtp_own": mtp_own,
        "mtp_active_per_token_own": mtp_own - inactive_per_moe_layer,
        "mtp_saved_including_embedding_and_head_copies": mtp_own + embedding + lm_head,
        "checkpoint_total": main_total + mtp_own + embedding + lm_head,
    }


def learning_rate(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warmup to ``PEAK_LR``, then cosine decay to ``MIN_LR_RATIO * PEAK_LR`` at ``total_steps``."""
    if step < warmup_steps:
        return PEAK_LR * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_batches(
    stream: torch.Tensor, seq_len: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless deterministic batches of ``seq_len + 1``-token windows (stride ``seq_len``), reshuffled per epoch."""
    starts = torch.arange((stream.numel() - 1) // seq_len) * seq_len
    offsets = torch.arange(seq_len + 1)
    epoch = 0
    while True:
        order = starts[torch.randperm(starts.numel(), generator=torch.Generator().manual_seed(seed + epoch))]
        for i in range(0, order.numel() - batch_size + 1, batch_size):
            yield stream[order[i : i + batch_size, None] + offsets]
        epoch += 1


def validation_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len`` predicted tokens from the start of the validation stream."""
    count = min(max_tokens, stream.numel() - 1) // seq_len
    return stream[torch.arange(count)[:, None] * seq_len + torch.arange(seq_len + 1)]


def forward_losses(
    model: DeepseekV3ForCausalLM, mtp: MultiTokenPredictor, windows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Main and MTP logits and mean losses for a batch of ``seq_len + 1``-token windows."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)
    main_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    # h_i with t_{i+1} predicts t_{i+2}; the last position has no t_{i+2} inside the window.
    mtp_logits = mtp(hidden[:, :-1], targets[:, :-1], model.model.rotary_emb)
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), targets[:, 1:].flatten())
    return logits, mtp_logits, main_loss, mtp_loss


def train(
    model: DeepseekV3ForCausalLM,
    mtp: MultiTokenPredictor,
    tracker: RouterLoadTracker,
    stream: torch.Tensor,
    settings: RunSettings,
) -> dict[str, object]:
    """Run the training loop; returns the training section of the report."""
    parameters = list({id(p): p for module in (model, mtp) for p in module.parameters()}.values())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=PEAK_LR,
        betas=ADAM_BETAS,
        fused=False,
        foreach=True,
    )
    model.train()
    mtp.train()
    batches = training_batches(stream, settings.seq_len, settings.batch_size, settings.seed)
    total_steps = settings.steps if settings.steps is not None else CALIBRATION_STEPS
    start = time.time()
    deadline = start + settings.minutes * 60
    history: list[tuple[float, float]] = []
    stopped_early = False
    step = 0
    while step < total_steps:
        if time.time() > deadline:
            stopped_early = True
            break
        lr = learning_rate(step, total_steps, settings.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tracker.reset()
        _, _, main_loss, mtp_loss = forward_losses(model, mtp, next(batches))
        (main_loss + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(parameters, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.update_biases(BIAS_UPDATE_SPEED)
        history.append((main_loss.item(), mtp_loss.item()))
        step += 1
        if settings.steps is None and step == CALIBRATION_STEPS:
            seconds_per_step = (time.time() - start) / step
            total_steps = step + int((deadline - time.time()) / seconds_per_step)
            print(f"calibration: {seconds_per_step:.2f} s/step -> {total_steps} steps", flush=True)
        if step % LOG_EVERY == 0 or step == total_steps:
            elapsed = time.time() - start
            tokens = step * settings.batch_size * settings.seq_len
            worst = max(tracker.max_over_mean().values())
            print(
                f"step {step}/{total_steps} loss {main_loss.item():.4f} mtp {mtp_loss.item():.4f} lr {lr:.2e} "
                f"tok/s {tokens / elapsed:.0f} elapsed {elapsed:.0f}s max-load/mean {worst:.2f}",
                flush=True,
            )
    seconds = time.time() - start
    tail = history[-20:]
    tokens_seen = step * settings.batch_size * settings.seq_len
    return {
        "steps": step,
        "planned_steps": total_steps,
        "stopped_early_by_time_budget": stopped_early,
        "seq_len": settings.seq_len,
        "batch_size": settings.batch_size,
        "tokens_per_step": settings.batch_size * settings.seq_len,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / stream.numel(),
        "train_seconds": seconds,
        "tokens_per_second": tokens_seen / seconds,
        "final_train_loss": history[-1][0],
        "final_train_loss_mean_last_20_steps": sum(h[0] for h in tail) / len(tail),
        "final_mtp_train_loss_mean_last_20_steps": sum(h[1] for h in tail) / len(tail),
        "first_train_loss": history[0][0],
        "optimizer": {
            "name": "AdamW",
            "peak_lr": PEAK_LR,
            "min_lr": PEAK_LR * MIN_LR_RATIO,
            "schedule": "linear warmup then cosine decay",
            "warmup_steps": settings.warmup_steps,
            "betas": list(ADAM_BETAS),
            "weight_decay": WEIGHT_DECAY,
            "weight_decay_applies_to": "parameters with ndim >= 2",
            "grad_clip_norm": GRAD_CLIP,
        },
        "mtp_loss_weight": MTP_LOSS_WEIGHT,
        "load_balancing": {
            "method": "aux-loss-free: after each step e_score_correction_bias += gamma * sign(mean_load - load)",
            "gamma": BIAS_UPDATE_SPEED,
            "sequence_wise_balance_loss": "not used",
            "routers": list(tracker.routers),
        },
    }


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForCausalLM,
    mtp: MultiTokenPredictor,
    tracker: RouterLoadTracker,
    windows: torch.Tensor,
    unigram_log_probs: torch.Tensor,
    batch_size: int,
) -> dict[str, object]:
    """Validation metrics of the main model, the MTP module and the unigram baseline."""
    model.eval()
    mtp.eval()
    tracker.reset()
    sums = dict.fromkeys(("main_nll", "main_correct", "unigram_nll", "mtp_nll", "mtp_correct", "agree"), 0.0)
    for chunk in windows.split(batch_size):
        targets = chunk[:, 1:]
        logits, mtp_logits, main_loss, mtp_loss = forward_losses(model, mtp, chunk)
        main_pred = logits.argmax(-1)
        mtp_pred = mtp_logits.argmax(-1)
        sums["main_nll"] += main_loss.item() * targets.numel()
        sums["main_correct"] += (main_pred == targets).sum().item()
        sums["unigram_nll"] -= unigram_log_probs[targets].sum().item()
        sums["mtp_nll"] += mtp_loss.item() * targets[:, 1:].numel()
        sums["mtp_correct"] += (mtp_pred == targets[:, 1:]).sum().item()
        sums["agree"] += (mtp_pred == main_pred[:, 1:]).sum().item()
    main_positions = windows[:, 1:].numel()
    mtp_positions = windows[:, 2:].numel()
    loss = sums["main_nll"] / main_positions
    unigram_loss = sums["unigram_nll"] / main_positions
    mtp_loss = sums["mtp_nll"] / mtp_positions
    return {
        "windows": windows.shape[0],
        "window_tokens": windows.shape[1] - 1,
        "predicted_tokens": main_positions,
        "loss": loss,
        "perplexity": math.exp(loss),
        "top1_accuracy": sums["main_correct"] / main_positions,
        "unigram_loss": unigram_loss,
        "unigram_perplexity": math.exp(unigram_loss),
        "perplexity_over_unigram_perplexity": math.exp(loss - unigram_loss),
        "mtp_predicted_tokens": mtp_positions,
        "mtp_loss": mtp_loss,
        "mtp_perplexity": math.exp(mtp_loss),
        "mtp_top1_accuracy": sums["mtp_correct"] / mtp_positions,
        "mtp_top1_agreement_with_main_next_position": sums["agree"] / mtp_positions,
        "expert_load_max_over_mean": tracker.max_over_mean(),
        "e_score_correction_bias_range": {
            name: [router.e_score_correction_bias.min().item(), router.e_score_correction_bias.max().item()]
            for name, router in tracker.routers.items()
        },
    }


def save_model(out: Path, model: DeepseekV3ForCausalLM, mtp: MultiTokenPredictor) -> dict[str, object]:
    """Write config.json, model.safetensors (main + MTP tensors) and generation_config.json."""
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    tensors.update({mtp_prefix + name: t for name, t in mtp.checkpoint_tensors().items()})
    tensors = to_published_layout(tensors)  # DeepSeek's per-expert tensor names, as most tools read them
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size >= FP32_CHECKPOINT_LIMIT_BYTES:
        raise RuntimeError(f"float32 checkpoint is {size} bytes; shrink the model or save bfloat16")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)  # safetensors creates the file private (0600)
    model.config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=SPECIAL_TOKENS.index(PAD), do_sample=False
    ).save_pretrained(out)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return {
        "dtype": "float32",
        "tensors": len(tensors),
        "mtp_tensors": sorted(name for name in tensors if name.startswith(mtp_prefix)),
        "bytes": (out / "model.safetensors").stat().st_size,
        "sha256": digest,
    }


def save_tokenizer(out: Path, tokenizer: Tokenizer) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template)."""
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )


CHAT_CHECK_CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    },
    {"role": "tool", "content": "R"},
    {"role": "assistant", "content": "A"},
    {"role": "user", "content": "V"},
]
CHAT_CHECK_EXPECTED = (
    f"{BOS}S<｜User｜>U<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
    f'```json\n{{"x": 1}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>{EOS}'
    f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>R<｜tool▁output▁end｜><｜tool▁outputs▁end｜>A{EOS}"
    "<｜User｜>V<｜Assistant｜>"
)


def transformers_mtp_logits(
    main: DeepseekV3ForCausalLM,
    tensors: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
) -> torch.Tensor:
    """MTP logits from transformers' own ``MtpModel`` loaded with the checkpoint's MTP tensors.

    An independent implementation of the same module: it numbers positions from ``i + 1`` and shares the
    main model's embedding and head (equal to the saved copies, which the caller checks).
    """
    reference = MtpModel(main, 1).eval()
    state = {}
    for name, tensor in tensors.items():
        if name.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        if name.startswith("shared_head.norm."):
            state["layers.0.post_norm.weight"] = tensor
        elif name.startswith(("enorm.", "hnorm.", "eh_proj.")):
            state[f"layers.0.{name}"] = tensor
        else:
            state[f"layers.0.mtp_block.{name}"] = tensor
    missing, unexpected = reference.load_state_dict(state, strict=False)
    if unexpected or any(not name.startswith(("embed_tokens.", "shared_head.")) for name in missing):
        raise RuntimeError(f"MtpModel state mismatch: missing {missing}, unexpected {unexpected}")
    position_ids = torch.arange(1, next_ids.shape[1] + 1).expand(next_ids.shape[0], -1)
    out = reference.forward_layer(0, hidden, position_ids, None, input_ids=next_ids)
    return reference._project_to_logits(out)


@torch.no_grad()
def verify_saved(
    out: Path,
    model: DeepseekV3ForCausalLM,
    mtp: MultiTokenPredictor,
    tokenizer: Tokenizer,
    sample: torch.Tensor,
    mtp_names: list[str],
) -> dict[str, object]:
    """Reload the folder and check keys, main and MTP logits, the tokenizer and the chat template."""
    model.eval()
    mtp.eval()
    loaded, info = DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True)
    loaded.eval()
    if info["missing_keys"] or info["mismatched_keys"] or info["error_msgs"]:
        raise RuntimeError(f"loading problems: {info}")
    unexpected = sorted(info["unexpected_keys"])

    trained_logits, trained_mtp, _, _ = forward_losses(model, mtp, sample)
    hidden = loaded.model(input_ids=sample[:, :-1], use_cache=False).last_hidden_state
    loaded_logits = loaded.lm_head(hidden)

    # Rebuild the MTP module from the file alone (own embedding and head) and compare its logits.
    mtp_prefix = f"model.layers.{loaded.config.num_hidden_layers}."
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        main_embedding, main_head = (
            handle.get_tensor("model.embed_tokens.weight"),
            handle.get_tensor("lm_head.weight"),
        )
        tensors = to_fused_layout(
            {
                key.removeprefix(mtp_prefix): handle.get_tensor(key)
                for key in handle.keys()  # noqa: SIM118 - safe_open handles are not iterable
                if key.startswith(mtp_prefix)
            }
        )
    config = loaded.config
    fresh = MultiTokenPredictor(
        config,
        nn.Embedding(config.vocab_size, config.hidden_size),
        nn.Linear(config.hidden_size, config.vocab_size, bias=False),
    )
    fresh.load_state_dict({MultiTokenPredictor.module_name(k): v for k, v in tensors.items()}, strict=True)
    fresh.eval()
    loaded_mtp = fresh(hidden[:, :-1], sample[:, 1:-1], loaded.model.rotary_emb)
    reference_mtp = transformers_mtp_logits(loaded, tensors, hidden[:, :-1], sample[:, 1:-1])

    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    text = "def add(a, b):\n    return a + b  # ünïcode\n"
    rendered = hf_tokenizer.apply_chat_template(
        CHAT_CHECK_CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    checks = {
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys_reported_by_transformers": len(unexpected),
        "unexpected_keys_are_exactly_the_mtp_tensors": unexpected
        == sorted({fused_name(n) for n in mtp_names}),
        "main_logits_equal_after_reload": torch.equal(trained_logits, loaded_logits),
        "main_logits_max_abs_diff": (trained_logits - loaded_logits).abs().max().item(),
        "mtp_logits_equal_after_reload": torch.equal(trained_mtp, loaded_mtp),
        "mtp_logits_max_abs_diff": (trained_mtp - loaded_mtp).abs().max().item(),
        "mtp_embedding_and_head_copies_equal_main": torch.equal(
            tensors["embed_tokens.weight"], main_embedding
        )
        and torch.equal(tensors["shared_head.head.weight"], main_head),
        "mtp_matches_transformers_MtpModel": torch.allclose(loaded_mtp, reference_mtp, rtol=0, atol=1e-4),
        "mtp_vs_transformers_MtpModel_max_abs_diff": (loaded_mtp - reference_mtp).abs().max().item(),
        "hf_tokenizer_matches_tokenizers": hf_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids,
        "hf_tokenizer_adds_bos": hf_tokenizer(text)["input_ids"][0] == tokenizer.token_to_id(BOS),
        "chat_template_renders_expected": rendered == CHAT_CHECK_EXPECTED,
    }
    failed = [name for name, value in checks.items() if value is False]
    if failed:
        raise RuntimeError(f"verification failed: {failed}")
    return checks


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or the machine type where that is unavailable."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else f"{platform.machine()} CPU"


def corpus_report(corpus: Corpus, train_stream: torch.Tensor, val_stream: torch.Tensor) -> dict[str, object]:
    """The corpus section of the report: sources, split rule, sizes and exclusions."""

    def sizes(documents: list[tuple[str, str]], stream: torch.Tensor) -> dict[str, int]:
        return {
            "files": len(documents),
            "bytes": sum(len(text.encode("utf-8")) for _, text in documents),
            "tokens": stream.numel(),
        }

    descriptions = {
        **EXCLUDED_PREFIXES,
        "generated-codec": "encodings/ charmap codec tables generated by gencodec.py",
        "invalid": "not UTF-8 or not parseable by this interpreter (deliberately broken fixtures)",
    }
    return {
        "source": f"Python {platform.python_version()} standard library (.py files)",
        "stdlib_dir": str(corpus.root),
        "licence": "PSF-2.0 (Python Software Foundation License Version 2)",
        "split": f"validation if int.from_bytes(sha256(relative_path)[:8], 'big') % 1000 < {VALIDATION_PER_MILLE}",
        "train": sizes(corpus.train, train_stream),
        "val": sizes(corpus.val, val_stream),
        "tokens_include_bos_and_eos_per_file": True,
        "excluded": {
            reason: {
                "files": len(paths),
                "why": descriptions[reason],
                "paths": paths if len(paths) <= 10 else [],
            }
            for reason, paths in corpus.excluded.items()
        },
    }


def architecture_report(config: DeepseekV3Config) -> dict[str, object]:
    """The architecture fields of the config that define the model."""
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "first_k_dense_replace",
        "intermediate_size",
        "moe_intermediate_size",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "rope_interleave",
        "rope_parameters",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "num_nextn_predict_layers",
        "scoring_func",
        "topk_method",
    )
    return {key: getattr(config, key) for key in keys}


def write_model_card(out: Path, report: dict) -> None:
    """Write README.md, the model card, from the training report."""
    arch, params, corpus = report["architecture"], report["parameters"], report["corpus"]
    training, val, software = report["training"], report["validation"], report["software"]

    def millions(n: int) -> str:
        return f"{n / 1e6:.2f} M"

    excluded = "\n".join(
        f"  - `{reason}`: {item['files']} files ({item['why']})"
        for reason, item in corpus["excluded"].items()
    )
    loads = ", ".join(f"{v:.2f}" for v in val["expert_load_max_over_mean"].values())
    card = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
  - deepseek_v3
  - tiny
  - test-model
---

# {MODEL_NAME}

A tiny model with the DeepSeek-V3 architecture (multi-head latent attention, DeepSeekMoE with a shared
expert and group-limited aux-loss-free sigmoid routing, one multi-token-prediction module), trained from
scratch on the Python standard library. It exists to test inference engines (deepinfer) against real, trained
weights with non-trivial routing; it is not useful as a code assistant.

Loads with `transformers.DeepseekV3ForCausalLM.from_pretrained` (float32). Produced by
`tools/train_tiny.py` in the deepinfer repository: `{report["command"]}`.

## Data

- Source: {corpus["source"]}, `{corpus["stdlib_dir"]}`.
- Licence of the data: {corpus["licence"]}. Licence of the weights: Apache-2.0 (the deepinfer project's).
- Split by file: {corpus["split"]}.
- Train: {corpus["train"]["files"]} files, {corpus["train"]["bytes"]:,} bytes, {corpus["train"]["tokens"]:,} tokens.
- Validation: {corpus["val"]["files"]} files, {corpus["val"]["bytes"]:,} bytes, {corpus["val"]["tokens"]:,} tokens.
- Each file is one document: `{BOS}` + text + `{EOS}`; documents are concatenated and cut into windows.
- Excluded:
{excluded}

## Tokenizer

Byte-level BPE (`tokenizers`), {report["tokenizer"]["vocab_size"]} entries including the 16 DeepSeek-V3
special tokens (ids 0-15; BOS = 0, EOS = 1, pad = `{PAD}`), trained on the train split only. Decoding
round-trips every corpus file and arbitrary Unicode. `tokenizer_config.json` carries a DeepSeek-V3-style
chat template (`<｜User｜>`, `<｜Assistant｜>`, end-of-sentence, tool-call markers); the model never saw chat
data, so the template only fixes the format.

## Architecture

| field | value |
|---|---|
| hidden size / layers | {arch["hidden_size"]} / {arch["num_hidden_layers"]} ({arch["first_k_dense_replace"]} dense, then MoE) |
| attention | MLA, {arch["num_attention_heads"]} heads, q_lora_rank {arch["q_lora_rank"]}, kv_lora_rank {arch["kv_lora_rank"]}, qk_nope {arch["qk_nope_head_dim"]}, qk_rope {arch["qk_rope_head_dim"]} (interleaved), v {arch["v_head_dim"]} |
| dense MLP | intermediate {arch["intermediate_size"]} |
| MoE | {arch["n_routed_experts"]} routed + {arch["n_shared_experts"]} shared experts of {arch["moe_intermediate_size"]}, top-{arch["num_experts_per_tok"]}, {arch["n_group"]} groups / top-{arch["topk_group"]} groups, sigmoid + `e_score_correction_bias` (noaux_tc), normalised top-k, routed_scaling_factor {arch["routed_scaling_factor"]} (DeepSeek-V3's value, so an engine that drops the factor visibly changes the output) |
| RoPE | {arch["rope_parameters"]}, max_position_embeddings {arch["max_position_embeddings"]} |
| MTP | 1 module (`model.layers.{arch["num_hidden_layers"]}.*`, DeepSeek naming), loss weight {training["mtp_loss_weight"]} |

Parameters: main model {millions(params["main_total"])} (embedding {millions(params["main_embedding"])},
untied lm_head {millions(params["main_lm_head"])}), {millions(params["main_active_per_token"])} active per
token; MTP module {millions(params["mtp_own"])} of its own ({millions(params["mtp_active_per_token_own"])}
active) plus copies of the embedding and head; checkpoint total {millions(params["checkpoint_total"])}
({report["checkpoint"]["bytes"]:,} bytes, float32).

The MTP tensors (`embed_tokens`, `enorm`, `hnorm`, `eh_proj` = [hidden, 2 * hidden] applied to
`cat([enorm(embedding of t(i+1)), hnorm(final-normed h(i))])`, the decoder layer, `shared_head.norm`,
`shared_head.head`) sit in `model.safetensors`; transformers reports them as unexpected keys and ignores them.

## Training

- {training["steps"]} AdamW steps of {training["batch_size"]} x {training["seq_len"]} tokens
  ({training["tokens_seen"]:,} tokens, {training["epochs"]:.2f} epochs), peak LR {training["optimizer"]["peak_lr"]},
  warmup {training["optimizer"]["warmup_steps"]} steps then cosine decay, seed {report["seed"]}.
- Load balancing: {training["load_balancing"]["method"]}, gamma {training["load_balancing"]["gamma"]}; no
  auxiliary balance loss.
- Hardware: {software["hardware"]} (shared with other jobs, so timings are noisy), {software["torch_threads"]}
  torch threads, float32. Training took
  {training["train_seconds"] / 60:.1f} min ({training["tokens_per_second"]:.0f} tokens/s); the whole run
  {report["wall_seconds"] / 60:.1f} min.
- Final train loss {training["final_train_loss_mean_last_20_steps"]:.3f} (mean of the last 20 steps).

## Evaluation

On the first {val["predicted_tokens"]:,} tokens of the validation split ({val["windows"]} non-overlapping
windows of {val["window_tokens"]} tokens):

| metric | value |
|---|---|
| validation loss / perplexity | {val["loss"]:.3f} / {val["perplexity"]:.2f} |
| unigram baseline perplexity (add-one smoothed train counts) | {val["unigram_perplexity"]:.1f} |
| perplexity / unigram perplexity | {val["perplexity_over_unigram_perplexity"]:.4f} |
| next-token top-1 accuracy | {val["top1_accuracy"]:.3f} |
| MTP loss / perplexity (token i+2) | {val["mtp_loss"]:.3f} / {val["mtp_perplexity"]:.2f} |
| MTP top-1 accuracy (token i+2) | {val["mtp_top1_accuracy"]:.3f} |
| MTP top-1 agreement with the main model's next position | {val["mtp_top1_agreement_with_main_next_position"]:.3f} |
| busiest expert load / mean load per MoE layer | {loads} |

## Known limits

- Trained on {training["seq_len"]}-token windows although `max_position_embeddings` is
  {arch["max_position_embeddings"]}: positions beyond {training["seq_len"]} were never trained (plain RoPE, no
  YaRN), so quality past them is untested and expected to drop.
- Tiny model, little data, {training["train_seconds"] / 60:.0f} minutes of CPU training: completions are
  Python-flavoured but often wrong; it has never seen chat, `<think>` or tool-call data, and those special
  tokens' embeddings are essentially untrained.
- Single-file documents only; no deduplication; near-duplicate files across the split are possible.
- Software: Python {software["python"]}, torch {software["torch"]}, transformers {software["transformers"]},
  tokenizers {software["tokenizers"]}.
"""
    (out / "README.md").write_text(card)


def main(argv: list[str] | None = None) -> None:
    """Build the corpus and tokenizer, train, evaluate, save and verify the model folder."""
    ensure_runtime_environment()
    settings = parse_args(argv)
    wall_start = time.time()
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    settings.out.mkdir(parents=True, exist_ok=True)

    corpus = collect_corpus(Path(sysconfig.get_paths()["stdlib"]), settings.quick)
    train_texts = [text for _, text in corpus.train]
    val_texts = [text for _, text in corpus.val]
    tokenizer = train_tokenizer(train_texts)
    train_ids, train_stream = encode_documents(tokenizer, train_texts)
    val_ids, val_stream = encode_documents(tokenizer, val_texts)
    round_trip = check_round_trip(tokenizer, train_texts + val_texts, train_ids + val_ids)
    print(
        f"corpus: {len(train_texts)} train files / {train_stream.numel():,} tokens, {len(val_texts)} val files / "
        f"{val_stream.numel():,} tokens ({time.time() - wall_start:.0f}s)",
        flush=True,
    )

    torch.manual_seed(settings.seed)
    config = build_config(tokenizer.get_vocab_size())
    model = DeepseekV3ForCausalLM._from_config(
        config, attn_implementation="sdpa", experts_implementation="grouped_mm"
    )
    model.config.dtype = torch.float32
    mtp = MultiTokenPredictor(model.config, model.model.embed_tokens, model.lm_head)
    for module in (mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.block, mtp.shared_head["norm"]):
        module.apply(model._init_weights)
    routers = {
        f"model.layers.{i}.mlp.gate": layer.mlp.gate
        for i, layer in enumerate(model.model.layers)
        if i >= config.first_k_dense_replace
    }
    routers[f"model.layers.{config.num_hidden_layers}.mlp.gate"] = mtp.block.mlp.gate
    tracker = RouterLoadTracker(routers)
    params = parameter_counts(model, mtp)
    print(f"parameters: {json.dumps(params)}", flush=True)

    training = train(model, mtp, tracker, train_stream, settings)
    counts = torch.bincount(train_stream, minlength=config.vocab_size).double()
    unigram_log_probs = torch.log((counts + 1) / (counts.sum() + config.vocab_size))
    windows = validation_windows(val_stream, settings.seq_len, settings.val_tokens)
    validation = evaluate(model, mtp, tracker, windows, unigram_log_probs, settings.batch_size)
    print(f"validation: {json.dumps(validation)}", flush=True)

    checkpoint = save_model(settings.out, model, mtp)
    save_tokenizer(settings.out, tokenizer)
    verification = verify_saved(settings.out, model, mtp, tokenizer, windows[:2], checkpoint["mtp_tensors"])
    report = {
        "model": MODEL_NAME,
        "command": " ".join(["python", "tools/train_tiny.py", *(sys.argv[1:] if argv is None else argv)]),
        "seed": settings.seed,
        "quick": settings.quick,
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "hardware": f"{cpu_name()}, {os.cpu_count()} cores",
            "torch_threads": torch.get_num_threads(),
            "environment": {name: os.environ[name] for name in ("GLIBC_TUNABLES", "GOMP_SPINCOUNT")},
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": model.config._experts_implementation,
        },
        "corpus": corpus_report(corpus, train_stream, val_stream),
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), ByteLevel pre-tokenizer and decoder, BOS-prepending post-processor",
            "vocab_size": tokenizer.get_vocab_size(),
            "special_tokens": {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS},
            "trained_on": "train split only",
            "round_trip": round_trip,
        },
        "architecture": architecture_report(model.config),
        "parameters": params,
        "training": training,
        "validation": validation,
        "checkpoint": {key: value for key, value in checkpoint.items() if key != "mtp_tensors"},
        "verification": verification,
        "wall_seconds": time.time() - wall_start,
    }
    (settings.out / "training_report.json").write_text(
        json.dumps(report, indent=2, ensure_ascii=False) + "\n"
    )
    write_model_card(settings.out, report)
    print(f"wrote {settings.out} in {report['wall_seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
