"""The chat recipe: DeepSeek's chat format, in (prompts) and out (reasoning, answers, tool calls).

``ChatRecipe(tokenizer)`` is bound to one model's tokenizer: ``encode_chat(messages, tools,
thinking)`` returns prompt token ids in which only the template places control tokens, and
``parser(prompt_ids)`` reads a completion back incrementally (``decode_chat`` in one go). The
module-level ``encode_chat(tokenizer, ...)`` / ``decode_chat(tokenizer, ...)`` use a cached recipe.
Only ``tokenizers`` and ``pydantic`` are needed (no torch).
"""

from deepinfer.recipe.chat import ChatRecipe, decode_chat, encode_chat, recipe_for
from deepinfer.recipe.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    ToolSpec,
    UserMessage,
)
from deepinfer.recipe.parser import (
    Block,
    BlockDelta,
    BlockEnd,
    BlockStart,
    ChatEvent,
    ChatOutputParser,
    ParsedMessage,
)
from deepinfer.recipe.stop_strings import StopStringBuffer

__all__ = [
    "AssistantMessage",
    "Block",
    "BlockDelta",
    "BlockEnd",
    "BlockStart",
    "ChatEvent",
    "ChatOutputParser",
    "ChatRecipe",
    "Message",
    "ParsedMessage",
    "StopStringBuffer",
    "SystemMessage",
    "ToolCall",
    "ToolMessage",
    "ToolSpec",
    "UserMessage",
    "decode_chat",
    "encode_chat",
    "recipe_for",
]
