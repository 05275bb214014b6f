"""Offline generation on an :class:`~tokenfleet.worker.engine.engine.Engine`: prompts in, whole
completions out (``Engine.generate``; the worker drives ``step()`` itself)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenfleet.worker.engine.outputs import CompletionOutput
from tokenfleet.worker.engine.request import SamplingParams

if TYPE_CHECKING:
    from tokenfleet.worker.engine.engine import Engine


def generate(
    engine: Engine,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    *,
    batch_id: int,
) -> list[CompletionOutput]:
    """Run ``prompts`` to completion on an idle ``engine``, in order (request ids
    ``generate-{batch_id}-{i}``); ``params``: one for all, or one per prompt."""
    if engine.has_unfinished():
        raise RuntimeError("generate() needs an idle engine; drive step() instead")
    if params is None or isinstance(params, SamplingParams):
        params_list = [params or SamplingParams()] * len(prompts)
    else:
        params_list = list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} params for {len(prompts)} prompts")
    ids = [f"generate-{batch_id}-{i}" for i in range(len(prompts))]
    results = {rid: CompletionOutput(request_id=rid) for rid in ids}
    for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
        engine.add_request(rid, prompt, p)
        results[rid].prompt_token_ids = engine.prompt_token_ids(rid)
    while engine.has_unfinished():
        for out in engine.step():
            res = results[out.request_id]
            res.token_ids.extend(out.new_token_ids)
            res.text += out.new_text
            if out.finished:
                res.finish_reason = out.finish_reason
                res.error_code, res.error_message = out.error_code, out.error_message
                res.timings = out.timings
    return [results[rid] for rid in ids]
