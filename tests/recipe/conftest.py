"""Fixtures for the chat-recipe tests: a DeepSeek-style tokenizer and its recipe."""

from __future__ import annotations

import pytest

from deepinfer.recipe import ChatRecipe
from deepinfer.tokenizer import Tokenizer
from tests.recipe.deepseek_tokenizer import write_deepseek_tokenizer


@pytest.fixture(scope="session")
def deepseek_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("deepseek-tokenizer")
    write_deepseek_tokenizer(path)
    return Tokenizer(path)


@pytest.fixture(scope="session")
def recipe(deepseek_tokenizer: Tokenizer) -> ChatRecipe:
    return ChatRecipe(deepseek_tokenizer)
