"""The producer's routing chain is the engine's own prefix-cache hashes.

A ``RouteTokenizer`` built from the spec a worker publishes (``route_spec_of``: tokenizer JSON,
chat template, special tokens, block size) tokenizes chat messages, text prompts (long ones
cut) and token ids into a chain; a real engine runs the same request as a worker feeds it
(``EngineAdapter.prompt``: the chat template through transformers, then the tokenizer), and
every link of the chain must be among the blocks its prefix cache then holds (a ``PrefixSet``
watching it, as a worker's heartbeat publishes it). A prompt that differs in its first message
shares no link past the template's header. Tiny Llama and Qwen2 models (random, with a test
chat template) and SmolLM2-135M-Instruct (its own GGUF tokenizer and chat template).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.producer.core.request import build
from tokenfleet.producer.core.route_tokenizer import RouteTokenizer
from tokenfleet.shared.prefix_chain import link_positions, prefix_chain
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.engine.engine import Engine, EngineConfig
from tokenfleet.worker.engine.request import SamplingParams
from tokenfleet.worker.service.adapter import EngineAdapter
from tokenfleet.worker.service.prefix_set import PrefixSet
from tokenfleet.worker.service.routing_wiring import route_spec_of

SYSTEM = "You are a careful assistant. " * 12 + "Réponds en français, s'il te plaît. 東京 ✓"
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]


def check_chains_are_cached(model_dir: Path, block_size: int, *, chat_only: bool = False) -> None:
    """The module doc's check on one model."""
    engine = Engine(
        model_dir,
        EngineConfig(
            block_size=block_size, num_kv_blocks=8192 // block_size, device="cpu", max_wait_s=None
        ),
    )
    watcher = PrefixSet()
    engine.watch_prefix_cache(watcher)
    spec = route_spec_of(engine.tokenizer, block_size)
    assert spec is not None, "a fast tokenizer publishes a spec"
    router = RouteTokenizer(spec)
    adapter = EngineAdapter(engine, lambda req: SamplingParams(max_tokens=1), avg_prompt_tokens=0.0)
    settings = Settings(redis_url="redis://127.0.0.1:1", key_prefix="rc")
    long_text = ("The quick brown fox jumps over the lazy dog. " * 40 + "Ünïcödé ✓ 東京. ") * 3
    all_cases: list[dict[str, Any]] = [
        {"messages": CONVERSATION},
        {"messages": CONVERSATION[:2]},
        {"prompt": long_text},
        {"prompt": list(range(3, 3 + 40 * block_size))},
    ]
    cases = all_cases[:2] if chat_only else all_cases
    router.max_chars = 2000  # the long text is cut: the tokens nearest the cut are left out
    chains = []
    for n, case in enumerate(cases):
        req = build(settings, now=time.time(), max_tokens=1, **case)
        chain = router.chain(
            prompt=req.prompt, messages=req.messages, prompt_token_ids=req.prompt_token_ids
        )
        assert len(chain) >= 3, case
        engine.add_request(f"r{n}", adapter.prompt(req), SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        held = set(watcher.snapshot())
        missing = [i for i, link in enumerate(chain) if link not in held]
        assert not missing, f"case {n}: links {missing} of {len(chain)} are not the engine's"
        chains.append(chain)
    # a conversation whose first message starts differently shares at most the template's
    # header blocks with the first one, and no link after them
    other = router.chain(messages=[{"role": "system", "content": "X" + SYSTEM}, *CONVERSATION[1:]])
    same = 0
    while same < len(other) and other[same] == chains[0][same]:
        same += 1
    assert same <= 2 and not set(other[same:]) & set(chains[0])
    # the turn before shares a leading run with the whole conversation
    shared = 0
    while shared < len(chains[1]) and chains[1][shared] == chains[0][shared]:
        shared += 1
    assert shared >= len(chains[1]) - 1 >= 2


@pytest.mark.parametrize("flavour", ["llama", "qwen2"])
def test_the_producers_chain_is_the_engines_cached_blocks(
    flavour: str, request: pytest.FixtureRequest
) -> None:
    check_chains_are_cached(Path(request.getfixturevalue(f"tiny_{flavour}_dir")), block_size=4)


def test_a_tokenizer_that_adds_bos_and_a_template_that_uses_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The tiny Llama with a post-processor that puts ``<|bos|>`` before every text prompt and a
    chat template that starts with ``{{ bos_token }}`` and marks the assistant's text with
    ``{% generation %}``: the special-token paths on both sides."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from tokenfleet.worker.devtools.tiny_model import BOS_TOKEN, CHAT_TEMPLATE

    variant = tmp_path / "tiny-bos"
    shutil.copytree(tiny_llama_dir, variant)
    tok = Tokenizer.from_file(str(variant / "tokenizer.json"))
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tok.save(str(variant / "tokenizer.json"))
    template = CHAT_TEMPLATE.replace(
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content']",
        "{% generation %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']",
    ).replace("+ '\n' }}", "+ '\n' }}{% endgeneration %}", 1)
    assert "{% generation %}" in template and "{% endgeneration %}" in template
    (variant / "chat_template.jinja").write_text("{{ bos_token }}" + template)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(variant)
    assert hf("hello")["input_ids"][0] == bos_id  # the engine's text prompts start with BOS
    rendered = hf.apply_chat_template(CONVERSATION[:2], tokenize=False)
    assert isinstance(rendered, str) and rendered.startswith(BOS_TOKEN)
    check_chains_are_cached(variant, block_size=4)


@pytest.mark.real_model
def test_the_same_with_smollm2_and_its_own_chat_template(smollm2_dir: Path) -> None:
    check_chains_are_cached(smollm2_dir, block_size=16, chat_only=True)


def test_the_chain_takes_blocks_at_its_link_positions_only() -> None:
    ids = list(range(1000))
    chain = prefix_chain(ids, 16)
    assert len(chain) == len(link_positions((1000 - 1) // 16))
    assert prefix_chain(ids[:16], 16) == ()  # the last token's block never counts
    assert prefix_chain(ids[:17], 16) == chain[:1]
    assert prefix_chain(ids[:200], 16) == chain[: len(link_positions(199 // 16))]
    with pytest.raises(ValueError, match="block_size"):
        prefix_chain(ids, 0)
