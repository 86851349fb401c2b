"""On an Ascend NPU (DEEPINFER_TEST_ACCELERATOR=ascend, run by ci/ascend.sh): the engine on the ascend
backend in bfloat16 decodes greedily the same tokens as the CPU reference in float32, and the Ascend C
sampling kernel, when built, passed its self-test.

Greedy parity across precisions holds up to near-ties: where the two token streams first differ, the
float32 run's two best candidates must lie within ``NEAR_TIE`` nats of each other (bfloat16 rounding can
swap them), and the comparison stops there. Two checkpoints: the tiny test model (widths the FIA MLA
kernel does not take natively, so decode pads) and one with DeepSeek's attention widths (512 + 64 latent,
128 + 64 / 128 heads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from tests.ascend.conftest import ON_ASCEND
from tests.conftest import write_tokenizer
from tests.model.hf_models import make_hf_checkpoint

pytestmark = pytest.mark.skipif(
    not ON_ASCEND, reason="needs an Ascend NPU (DEEPINFER_TEST_ACCELERATOR=ascend)"
)

NEAR_TIE = 0.05
PROMPTS = [[0, 5, 9, 23, 42], [0, 7, 7, 7, 7, 7, 7], list(range(3, 140))]
DEEPSEEK_WIDTHS = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_attention_heads=8,
    num_key_value_heads=8,
    hidden_size=256,
)


@pytest.fixture(scope="module")
def deepseek_widths_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek-widths")
    vocab = write_tokenizer(path)
    make_hf_checkpoint(path, vocab_size=vocab, **DEEPSEEK_WIDTHS)
    write_tokenizer(path)
    return path


def greedy(model: Path, accelerator: str, dtype: str) -> list:
    llm = LLM(str(model), accelerator=accelerator, dtype=dtype, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    return [out.outputs[0] for out in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


@pytest.mark.parametrize("checkpoint", ["tiny_model", "deepseek_widths_model"])
def test_greedy_tokens_match_the_cpu_reference(checkpoint: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(checkpoint)
    npu, cpu = greedy(model, "ascend", "bfloat16"), greedy(model, "cpu", "float32")
    for prompt, (got, want) in enumerate(zip(npu, cpu)):
        for step, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
            if a == b:
                continue
            best_two = sorted((lp.logprob for lp in want.logprobs[step].values()), reverse=True)[:2]
            gap = best_two[0] - best_two[1]
            assert gap < NEAR_TIE, (
                f"prompt {prompt}, step {step}: NPU {a} vs CPU {b}, CPU margin {gap:.3f} nats"
            )
            break


def test_the_built_sampling_kernel_passed_its_self_test() -> None:
    import torch

    from deepinfer.ops_ascend import native

    if not native.LIBRARY.is_file():
        pytest.skip(f"the Ascend C library is not built ({native.LIBRARY})")
    kernel, why = native.load_sampling_kernel(native.LIBRARY, torch.device("npu", 0))
    assert kernel is not None, why
