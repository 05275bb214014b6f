"""Structured outputs and logprobs as a user meets them: a real ``tokenfleet serve`` (uvicorn),
two real workers on SmolLM2 (the session's fleet, tests/models/real_fleet.py), the official
``openai`` SDK. Every JSON output is validated with
``jsonschema``; regex outputs must match whole; choices must be in the set; logprobs must equal
the log-softmax of Hugging Face's own forward pass; a worker SIGKILLed in the middle of a JSON
answer must still leave a valid answer (the other worker resumes it and re-advances the
grammar over the published tokens); a batch whose lines ask for schemas yields only valid
outputs. The workers' heartbeats are short (3 s) so the takeover happens within the test.
"""

from __future__ import annotations

import io
import json
import re
from enum import StrEnum
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from real_fleet import PREFIX, WORKERS, RealFleet
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def ask(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)
    color: Color


def test_parse_with_a_pydantic_model_returns_the_parsed_object(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.parse(
        model="default",
        messages=ask("Describe a pet as JSON with a name, an age and a color."),
        response_format=Pet,
        max_tokens=60,
        temperature=0,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet), r
    assert r.choices[0].finish_reason == "stop"
    assert 0 <= pet.age <= 30 and len(pet.name) <= 12


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "pattern": "^[A-Z][a-z]{2,15}$"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "kind": {"enum": ["capital", "port", "other"]},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 1,
            "maxItems": 2,
        },
        "location": {
            "type": "object",
            "properties": {
                "north": {"type": "boolean"},
                "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
            },
            "required": ["north", "continent"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "country", "population_millions", "kind", "landmarks", "location"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Tokyo", "Cairo", "Lima"]


def _schema_format() -> Any:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


@pytest.mark.timeout(900)  # eight generations of up to 160 tokens on a shared 2-core machine
def test_every_schema_output_validates_streamed_and_not(sdk: openai.OpenAI) -> None:
    outputs = []
    for i, city in enumerate(CITIES):
        kw: dict[str, Any] = {
            "model": "default",
            "messages": ask(f"Give facts about {city} as JSON."),
            "response_format": _schema_format(),
            "max_tokens": 160,
            "temperature": 0.7,
            "seed": i,
        }
        whole = sdk.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "stop", whole
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in sdk.chat.completions.create(stream=True, **kw)
            if c.choices
        )
        assert streamed == whole.message.content  # seeded: the same sample both ways
        outputs.append(whole.message.content or "")
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_parses(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        model="default",
        messages=ask("Reply with a short JSON object with a cat's name and age."),
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_vllm_structured_outputs_on_both_endpoints(sdk: openai.OpenAI) -> None:
    pattern = r"[A-Z][a-z]+ [0-9]{4}"
    r = sdk.completions.create(
        model="default",
        prompt="A famous city and a year: ",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    for text in ("I love this!", "This is awful.", "It is a chair."):
        c = sdk.chat.completions.create(
            model="default",
            messages=ask(f"Sentiment of: {text}"),
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert c.choices[0].message.content in choices
    g = sdk.completions.create(
        model="default",
        prompt="Yes or no? ",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "."'}},
    )
    assert g.choices[0].text in ("yes.", "no."), g
    j = sdk.completions.create(
        model="default",
        prompt="A person as JSON: ",
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA["properties"]["location"]}},
    )
    jsonschema.validate(json.loads(j.choices[0].text), SCHEMA["properties"]["location"])


def test_bad_specs_are_400s_naming_the_field(sdk: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema", "name' and 'schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format", "uniqueItems"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}},
         "structured_outputs.regex", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"choice": []}}},
         "structured_outputs.choice", "empty"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: nothing_here"}}},
         "structured_outputs.grammar", "unknown name"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ]  # fmt: skip
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="default", messages=ask("x"), max_tokens=4, **extra)
        body: Any = info.value.body
        assert body["param"] == param, body
        assert words in body["message"], body


def test_a_grammar_no_token_can_satisfy_ends_error_with_its_code(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        sdk.completions.create(
            model="default",
            prompt="x",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "[a&&b]"}},
        )
    body: Any = info.value.body
    assert body["code"] == "grammar_unsatisfiable", body


def _tokens_of(redis_url: str, request_id: str) -> list[int]:
    """The token ids of a request, as its worker published them."""
    from tokenfleet.producer import Client
    from tokenfleet.shared.schema import TokenEvent
    from tokenfleet.shared.settings import Settings

    settings = Settings.from_env({"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": PREFIX})
    with Client.from_url(settings=settings) as client:
        return [e.token_id for e in client.stream(request_id) if isinstance(e, TokenEvent)]


def test_logprobs_equal_hugging_faces_forward(
    sdk: openai.OpenAI, fleet: RealFleet, hf_smollm2: Any, smollm2_tokenizer: Any
) -> None:
    model = fleet.float32_model()  # HF computes in float32: so does this model's worker
    messages = ask("What is the capital of France?")
    r = sdk.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = r.choices[0].logprobs and r.choices[0].logprobs.content
    assert content, r
    ids = _tokens_of(fleet.redis_url, r.id)
    assert len(ids) == len(content)
    prompt = smollm2_tokenizer(
        smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompt + ids])).logits[0].float()
    expected = logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)].log_softmax(-1)
    for k, (token_id, entry) in enumerate(zip(ids, content, strict=True)):
        assert abs(entry.logprob - float(expected[k, token_id])) < 1e-3, (k, entry)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert len(entry.top_logprobs) == 5
        top = expected[k].topk(5)
        for alt, value in zip(entry.top_logprobs, top.values.tolist(), strict=True):
            assert abs(alt.logprob - value) < 1e-3
    # streamed: the same values, chunk by chunk; and the record returns them too
    streamed = [
        lp
        for c in sdk.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            stream=True,
        )
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for lp in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    record = httpx.get(f"{fleet.url}/requests/{r.id}", timeout=30).json()
    assert [e["logprob"] for e in record["logprobs"]] == [e.logprob for e in content]
    # a resumed stream (Last-Event-ID) carries them from where it resumes
    with httpx.stream(
        "GET", f"{fleet.url}/requests/{r.id}/events", headers={"Last-Event-ID": "3"}, timeout=30
    ) as resp:
        chunks = [
            json.loads(line[6:])
            for line in resp.iter_lines()
            if line.startswith("data: {") and '"logprobs":{' in line
        ]
    resumed = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in resumed] == [e.token for e in content[4:]]
    # completions' shape: logprobs: k
    comp = sdk.completions.create(
        model="default", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)


@pytest.mark.timeout(900)
def test_a_batch_of_json_schema_lines_yields_only_valid_outputs(sdk: openai.OpenAI) -> None:
    rows = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                "messages": ask(f"Facts about {city} as JSON."),
                "response_format": _schema_format(),
                "max_tokens": 160,
                "temperature": 0,
            },
        }
        for i, city in enumerate(CITIES)
    ]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    upload = sdk.files.create(file=("c.jsonl", io.BytesIO(data)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(
        lambda: (b := sdk.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
        "the batch to end",
        timeout_s=600,
        poll_s=0.1,
    )
    assert done.status == "completed" and done.output_file_id, done
    lines = sdk.files.content(done.output_file_id).text.splitlines()
    assert len(lines) == len(CITIES)
    for line in lines:
        choice = json.loads(line)["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_a_worker_killed_mid_json_still_yields_valid_json(
    sdk: openai.OpenAI, fleet: RealFleet
) -> None:
    """Runs last: it kills one of the two workers."""
    stream = sdk.chat.completions.create(
        model="default",
        messages=ask("Give facts about Rome as JSON."),
        response_format=_schema_format(),
        max_tokens=160,
        temperature=0,
        stream=True,
    )
    parts: list[str] = []
    killed = None
    for chunk in stream:
        if not chunk.choices:
            continue
        parts.append(chunk.choices[0].delta.content or "")
        if killed is None and len(parts) >= 10:  # a few tokens in: mid-answer
            record = httpx.get(f"{fleet.url}/requests/{chunk.id}", timeout=30).json()
            killed = record["worker"]
            assert killed in WORKERS, record
            fleet.workers[killed].kill()  # SIGKILL, reaped
    assert killed is not None
    text = "".join(parts)
    jsonschema.validate(json.loads(text), SCHEMA)
    record = httpx.get(f"{fleet.url}/requests/{chunk.id}", timeout=30).json()
    assert record["status"] == "done" and record["attempts"] == 2, record
    assert record["ran_on"] != killed and record["text"] == text
