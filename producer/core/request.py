"""Turn ``submit()`` arguments into a validated, encoded ``GenerationRequest`` (no Redis here).

Everything a caller can get wrong is refused here with ``InvalidRequest`` naming the field, before
anything touches Redis: empty prompt, ``max_tokens`` <= 0 or above the limit, negative
temperature, ``top_p`` outside (0, 1], unknown priority, payload over the size limit, text that
is not UTF-8.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson

from tokenfleet.producer.core.structured import constraint_of, tools_constraint
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import DEFAULT_MODEL, check_request_id
from tokenfleet.shared.prefix_chain import session_of
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import GenerationRequest, SamplingParams, check_text
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.tenants import (
    CHARS_PER_TOKEN,
    DEFAULT_TENANT,
    check_tenant,
    prompt_tokens,
)

# The keyword arguments submit() accepts besides the prompt (submit_many takes the same keys).
SUBMIT_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "seed",
        "priority",
        "model",
        "request_id",
        "deadline_s",
        "metadata",
        # structured outputs (core/structured.py) and logprobs
        "response_format",
        "json_schema",
        "regex",
        "choice",
        "grammar",
        "logprobs",
        "top_logprobs",
        # tools (shared/schema/tools.py)
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "tenant",  # who submits it (docs/fairness.md): not part of the request's payload
    }
)


@dataclass(slots=True)
class Prepared:
    """A validated request, reduced to what the enqueue script needs (an ``EnqueueItem`` as
    ``enqueue_keys_args`` takes it). Never changed once made; not frozen only because a frozen
    dataclass costs twice as much to build, once per request of a ``submit_many``."""

    request_id: str
    model: str
    priority: Priority
    deadline: float | None  # epoch seconds, or None
    payload: bytes  # the encoded GenerationRequest (what workers read)
    chosen_id: bool  # the client chose the id (so the enqueue script checks its fingerprint)
    session: str | None = None  # routing: the session key (prefix_chain.session_of), or None
    chain: tuple[str, ...] = ()  # routing: the prefix chain (empty: none, or not computed yet)
    # routing: what the chain is computed from once the model's RouteTokenizer is known
    # (prompt, messages, prompt_token_ids); None: nothing to route by prefix
    route_input: tuple[Any, Any, Any] | None = None
    tenant: str = DEFAULT_TENANT  # fair admission (docs/fairness.md)
    weight: float | None = None  # the tenant's weight to record (a gateway key's); None: kept
    prompt_tokens: int = 0  # what admission charges (tenants.prompt_tokens)

    @classmethod
    def of(cls, request: GenerationRequest, max_bytes: int, *, chosen_id: bool) -> Prepared:
        """Encode ``request`` (``InvalidRequest`` if over ``max_bytes``)."""
        return cls(
            request.request_id,
            request.model,
            request.priority,
            request.deadline,
            request.encode(max_bytes),
            chosen_id,
        )


# a bulk text prompt shorter than this is not tokenized for routing (it would fill about one
# 16-token block: no useful cached prefix, and submit_many's cost stays that of its encoding)
MIN_BULK_ROUTE_CHARS = 256


def new_request_id() -> str:
    """A fresh, unique request id: 128 random bits as 32 hex characters."""
    return os.urandom(16).hex()


def _split_prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if prompt is None:
        return None, None
    if isinstance(prompt, str | bytes | bytearray):
        return check_text("prompt", prompt), None
    if isinstance(prompt, Sequence):
        return None, tuple(prompt)
    raise InvalidRequest(
        f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
    )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, Sequence) and not isinstance(stop, bytes | bytearray):
        return tuple(stop)
    raise InvalidRequest(f"stop must be a string or a list of strings, got {stop!r}")


_NO_IDS: tuple[int, ...] = ()  # the default: skips the check on submit's hot path


def _token_ids(name: str, ids: Any) -> tuple[int, ...]:
    if isinstance(ids, Sequence) and not isinstance(ids, str | bytes | bytearray):
        return tuple(ids)
    raise InvalidRequest(f"{name} must be a list of token ids, got {ids!r}")


def prepare(settings: Settings, *, now: float, **params: Any) -> Prepared:
    """Validate and encode one request (``submit``'s keyword arguments); see :func:`build`.
    An unknown keyword is an ``InvalidRequest`` naming it (not a ``TypeError``)."""
    if not params.keys() <= SUBMIT_FIELDS:
        unknown = ", ".join(sorted(set(params) - SUBMIT_FIELDS))
        raise InvalidRequest(f"unknown request parameter(s): {unknown}")
    tenant = params.pop("tenant", None)
    request = build(settings, now=now, **params)
    prepared = prepared_for(settings, request, chosen_id=params.get("request_id") is not None)
    if tenant is not None:
        prepared.tenant = check_tenant(tenant)
    return prepared


def prepared_for(settings: Settings, request: GenerationRequest, *, chosen_id: bool) -> Prepared:
    """``request`` encoded for the enqueue script, with what routing needs (its session key;
    what its prefix chain is computed from): a submit's, or a dead letter's being requeued."""
    prepared = Prepared.of(request, settings.max_payload_bytes, chosen_id=chosen_id)
    prepared.prompt_tokens = prompt_tokens(
        request.prompt, request.messages, request.prompt_token_ids
    )
    if settings.routing != "off":
        prepared.session = session_of(request.metadata)
    if settings.routing == "prefix":  # the chain needs the model's tokenizer: the client adds it
        prepared.route_input = (request.prompt, request.messages, request.prompt_token_ids)
    return prepared


def build(
    settings: Settings,
    *,
    now: float,
    prompt: str | bytes | Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = _NO_IDS,
    ignore_eos: bool = False,
    seed: int | None = None,
    priority: str | int | Priority = "normal",
    model: str | None = None,
    request_id: str | None = None,
    deadline_s: float | None = None,
    metadata: dict[str, Any] | None = None,
    response_format: Any = None,
    json_schema: Any = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> GenerationRequest:
    """Validate one request; ``InvalidRequest`` names the first fault.

    ``deadline_s`` is relative (seconds from ``now``): the request must have *started* by then,
    else it ends ``expired``. At most one of ``response_format``, ``json_schema``, ``regex``,
    ``choice`` and ``grammar`` constrains the output (``core.structured``;
    docs/structured-outputs.md); ``tools`` + ``tool_choice`` (OpenAI's shapes) constrain it to
    calls of the offered functions (or, with ``auto``, text or calls), and cannot be combined
    with those.
    """
    if deadline_s is not None and (
        not isinstance(deadline_s, int | float)
        or isinstance(deadline_s, bool)
        or not math.isfinite(deadline_s)
        or deadline_s <= 0
    ):
        raise InvalidRequest(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    text, token_ids = _split_prompt(prompt)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=_stop_strings(stop),
        stop_token_ids=(
            _NO_IDS if stop_token_ids is _NO_IDS else _token_ids("stop_token_ids", stop_token_ids)
        ),
        ignore_eos=ignore_eos,
        structured=tools_constraint(
            constraint_of(
                response_format=response_format,
                json_schema=json_schema,
                regex=regex,
                choice=choice,
                grammar=grammar,
            ),
            tools,
            tool_choice,
            parallel_tool_calls,
        ),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    sampling.check_limit(settings.max_tokens_limit)
    request = GenerationRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        sampling=sampling,
        prompt=text,
        prompt_token_ids=token_ids,
        messages=tuple(dict(m) for m in messages) if messages is not None else None,
        priority=Priority.parse(priority),
        model=model if model is not None else DEFAULT_MODEL,
        deadline=now + deadline_s if deadline_s is not None else None,
        enqueued_at=now,
        metadata=metadata,
    )
    return request


def _spec_params(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(spec, str):
        return {"prompt": spec}
    if not isinstance(spec, Mapping):
        raise InvalidRequest(
            f"each request must be a prompt string or a mapping, got {type(spec).__name__}"
        )
    unknown = set(spec) - SUBMIT_FIELDS
    if unknown:
        raise InvalidRequest(f"unknown request field(s): {', '.join(sorted(unknown))}")
    return dict(spec)


_OWN_FIELDS = frozenset({"prompt", "request_id"})  # what each request of a template has of its own
_SLOW_FIELDS = frozenset({"messages", "metadata"})  # never on a template
_TEMPLATE_FIELDS = SUBMIT_FIELDS - _SLOW_FIELDS  # what a request on the fast path may have


def _shared_key(spec: Any) -> tuple[Any, ...] | None:
    """What a text-prompt request shares with others of the same batch, or None when it does
    not take the fast path (not a dict, unknown fields, token-id or chat prompts, metadata,
    unhashable values). Each value comes with its type, so ``1``, ``1.0`` and ``True`` never
    share a template; the same fields in another order only make a second template."""
    if (
        type(spec) is not dict
        or type(spec.get("prompt")) is not str
        or not spec.keys() <= _TEMPLATE_FIELDS
    ):
        return None
    key = tuple([(k, type(v), v) for k, v in spec.items() if k not in _OWN_FIELDS])
    try:
        hash(key)  # (hashing a tuple of strings, types and numbers: about 50 ns)
    except TypeError:
        return None
    return key


_ID_MARK = "tf-template-id-3c1e"
_PROMPT_MARK = "tf-template-prompt-9a7b"


class _Template:
    """A batch's shared parameters, validated once by building a full request.

    The template's encoding is cut around its id and prompt, so each request of the batch is
    encoded by concatenation; the bytes equal ``GenerationRequest.encode()``'s (tests check it).
    """

    __slots__ = ("parts", "request", "tenant")

    def __init__(self, settings: Settings, params: Mapping[str, Any], now: float) -> None:
        shared = {k: v for k, v in params.items() if k not in ("prompt", "request_id", "tenant")}
        tenant = params.get("tenant")
        self.tenant = DEFAULT_TENANT if tenant is None else check_tenant(tenant)
        self.request = build(settings, now=now, prompt=_PROMPT_MARK, request_id=_ID_MARK, **shared)
        encoded = orjson.dumps(self.request.to_dict())
        head, _, rest = encoded.partition(orjson.dumps(_ID_MARK))
        mid, _, tail = rest.partition(orjson.dumps(_PROMPT_MARK))
        if _ID_MARK.encode() in head + mid + tail or _PROMPT_MARK.encode() in head + mid + tail:
            raise InvalidRequest("request parameters must not contain tokenfleet's markers")
        self.parts = (head, mid, tail)

    def instance(self, max_bytes: int, prompt: str, request_id: str, chosen_id: bool) -> Prepared:
        """The same checks and encoding as ``build`` + ``encode``, for one text prompt (a str)
        and a request id that is new (``chosen_id`` False) or already checked."""
        if not prompt:
            raise InvalidRequest("prompt is empty")
        try:
            text = orjson.dumps(prompt)  # refuses lone surrogates, as check_text does
        except orjson.JSONEncodeError:
            check_text("prompt", prompt)  # raises the specific error
            raise
        head, mid, tail = self.parts
        payload = b"".join((head, orjson.dumps(request_id), mid, text, tail))
        if len(payload) > max_bytes:
            raise InvalidRequest(
                f"request is {len(payload)} bytes encoded; the limit is {max_bytes} bytes"
            )
        r = self.request
        prepared = Prepared(request_id, r.model, r.priority, r.deadline, payload, chosen_id)
        prepared.tenant = self.tenant
        prepared.prompt_tokens = max(1, -(-len(prompt) // CHARS_PER_TOKEN))  # tenants' count
        return prepared


def prepare_many(
    settings: Settings, specs: Sequence[str | Mapping[str, Any]], *, now: float
) -> list[Prepared]:
    """Validate every element of ``submit_many(requests)`` (a prompt string or a mapping of
    ``submit`` keyword arguments); the error names the index.

    Requests that differ only in their text prompt (and id) share one validated template, so a
    bulk batch validates its sampling parameters once; the payloads are byte-identical to what
    :func:`prepare` produces (tests check this).
    """
    out: list[Prepared] = []
    templates: dict[tuple[Any, ...], _Template] = {}
    max_bytes = settings.max_payload_bytes
    chains = settings.routing == "prefix"
    fresh_ids = os.urandom(16 * len(specs)).hex()  # one call: 32 hex characters per request
    for i, spec in enumerate(specs):
        try:
            params = {"prompt": spec} if type(spec) is str else spec
            key = _shared_key(params)
            if key is None:
                out.append(prepare(settings, now=now, **_spec_params(spec)))
                continue
            params = cast("dict[str, Any]", params)  # _shared_key took only a dict
            template = templates.get(key)
            if template is None:
                template = templates[key] = _Template(settings, params, now)
            rid = params.get("request_id")
            if rid is None:
                rid, chosen = fresh_ids[32 * i : 32 * i + 32], False
            else:
                rid, chosen = check_request_id(rid), True
            prepared = template.instance(max_bytes, params["prompt"], rid, chosen)
            if chains and len(params["prompt"]) >= MIN_BULK_ROUTE_CHARS:  # routed like submit's
                prepared.route_input = (params["prompt"], None, None)
            out.append(prepared)
        except InvalidRequest as exc:
            raise InvalidRequest(f"requests[{i}]: {exc}") from None
    return out
