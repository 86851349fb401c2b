"""How ``LLM.generate`` tokenizes string prompts (issue 34, defect 8, the offline side): control-token
text is parsed, as documented, because offline the prompt's author is the program's; plain text goes
through ``prompt_token_ids`` made with the plain-text encoder."""

from __future__ import annotations

from deepinfer import LLM, SamplingParams
from deepinfer.recipe import tokens as T
from deepinfer.recipe.tokens import plain_text_encoder

PROMPT = f"{T.EOS}{T.USER}x"


def test_string_prompts_parse_control_tokens_and_plain_ids_do_not() -> None:
    llm = LLM(num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    parsed = llm.generate(PROMPT, params)[0]
    assert parsed.prompt_token_ids == tokenizer.encode(PROMPT)
    assert tokenizer.token_to_id(T.USER) in parsed.prompt_token_ids

    plain_ids = [tokenizer.bos_token_id, *plain_text_encoder(tokenizer).encode(PROMPT)]
    plain = llm.generate(prompt_token_ids=[plain_ids], sampling_params=params)[0]
    assert tokenizer.token_to_id(T.USER) not in plain.prompt_token_ids[1:]
    assert tokenizer.decode(plain.prompt_token_ids, skip_special_tokens=True) == PROMPT
