"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepinfer.config import EngineConfig
from deepinfer.logger import get_logger
from deepinfer.model_zoo import resolve_model
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.text_input import require_valid_text
from deepinfer.threads import apply_thread_policy, policy_warning
from deepinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.parallel.front import DataParallelEngine

logger = get_logger(__name__)

# The offline engine's token budget per step unless one is given: larger than EngineConfig's (a
# server's, which bounds how long a prompt chunk stalls the decodes beside it), since offline only the
# total time counts. Fewer, larger prefill steps: 64 requests of 64-1024 prompt tokens ran 1.13x faster
# end to end at 8192 than at 2048 on 2 cores (bench offline, 3 alternated rounds).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 8192


class LLM:
    """Generate completions for batches of prompts.

    ``model`` is a Hugging Face model folder or a bundled model's name (``deepinfer-tiny-coder``, the
    default, or ``deepinfer-tiny-coder-fp8``: :mod:`deepinfer.model_zoo`); any other
    keyword is an ``EngineConfig`` field (``dtype``, ``weights``, ``max_model_len``,
    ``enable_prefix_caching`` ...); ``weights="as-stored"`` (default) keeps a quantised checkpoint's
    FP8 / MXFP4 weights in low precision where the backend has kernels for them, ``"bf16"`` /
    ``"fp32"`` dequantise them at load (``llm.engine.weights_summary`` says which);
    ``max_num_batched_tokens`` defaults to ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` here.
    ``data_parallel_size=N`` (with ``enable_expert_parallel=True`` to shard the experts) runs N rank
    processes (spawned: a script must guard its entry with ``if __name__ == "__main__":``).

    The first ``LLM()`` of a process that has not imported torch sets ``GOMP_SPINCOUNT=10000``
    (unless a wait policy is set) before it loads the engine, as every entry point does (:mod:`deepinfer.threads`);
    after an earlier ``import torch`` it is too late, and it logs a warning saying how to fix it.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        engine_options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        config = EngineConfig(model=str(resolve_model(model)), **engine_options)
        if not apply_thread_policy():  # before the engine's first import loads torch and OpenMP
            logger.warning(policy_warning())
        if config.data_parallel_size > 1:  # rank processes behind the same interface
            from deepinfer.parallel.front import DataParallelEngine

            self.engine: LLMEngine | DataParallelEngine = DataParallelEngine(config)
        else:
            from deepinfer.engine.llm_engine import LLMEngine

            self.engine = LLMEngine(config)

    def close(self) -> None:
        """Stop the data-parallel rank processes (a no-op for one process); also done at exit."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``prompts`` is a string, a list of strings, or a list of token-id lists; ``prompt_token_ids``
        is the explicit form of the latter. ``sampling_params`` is one SamplingParams for all prompts
        or one per prompt (default: ``SamplingParams()``).

        String prompts are tokenized as written, control tokens included: ``"<｜User｜>hi"`` gives the
        ``<｜User｜>`` token, so a chat template rendered to text keeps its markers. This differs from
        the server's ``/v1/completions``, whose prompts come from clients and are encoded as plain
        text unless a request sets ``parse_special_tokens``: offline, the prompt's author is the
        program's. To encode untrusted text as plain text here, pass ``prompt_token_ids`` made with
        ``deepinfer.recipe.tokens.plain_text_encoder(llm.get_tokenizer()).encode(text)`` (after the
        BOS, where the model wants one).
        """
        texts, ids = _normalise_prompts(prompts, prompt_token_ids)
        for i, text in enumerate(texts):
            if text is not None:
                require_valid_text(text, f"prompts[{i}]")
        count = len(texts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * count
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != count:
            raise ValueError(
                f"got {len(params)} sampling_params for {count} prompts; give one or one per prompt"
            )
        engine = self.engine
        request_ids = [engine.new_request_id() for _ in range(count)]
        try:
            for rid, text, token_ids, p in zip(request_ids, texts, ids, params):
                engine.add_request(rid, text, token_ids, p)
            finished: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [finished[rid] for rid in request_ids]


def _normalise_prompts(
    prompts: str | Sequence[str] | Sequence[Sequence[int]] | None,
    prompt_token_ids: Sequence[Sequence[int]] | None,
) -> tuple[list[str | None], list[list[int] | None]]:
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("give prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        return [None] * len(prompt_token_ids), [list(p) for p in prompt_token_ids]
    if prompts is None:
        raise ValueError("no prompts given")
    if isinstance(prompts, str):
        return [prompts], [None]
    prompts = list(prompts)
    if all(isinstance(p, str) for p in prompts):
        return prompts, [None] * len(prompts)
    if all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
        return [None] * len(prompts), [list(p) for p in prompts]
    raise ValueError("prompts must be a string, a list of strings, or a list of token-id lists")
