"""The OpenAI Batch API over HTTP: ``/v1/files`` and ``/v1/batches``.

Thin: each route checks the caller, then calls the batch core (``gateway.batches``: files,
batches, the runner that feeds their lines to the fleet). With API keys on, a file or batch
belongs to the key that created it (``Keys.owners``); another key gets 404 for it, as for
requests.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from tokenfleet.producer.gateway.batches.objects import NotFound
from tokenfleet.producer.gateway.gateway import Caller, Gateway
from tokenfleet.producer.gateway.routes_openai import CallerDep, gateway_of
from tokenfleet.shared.record import as_str
from tokenfleet.shared.tenants import DEFAULT_TENANT

router = APIRouter()


class BatchBody(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


async def _own(gw: Gateway, caller: Caller, what: str, object_id: str) -> None:
    """404 unless ``caller`` owns the object (always true with keys off)."""
    if caller.owner is None:
        return
    owner = as_str(await gw.client_redis.hget(gw.keys.owners, object_id))
    if owner != caller.owner:
        raise NotFound(what, object_id)


async def _claim(gw: Gateway, caller: Caller, object_id: str) -> None:
    if caller.owner is not None:
        await gw.client_redis.hset(gw.keys.owners, object_id, caller.owner)


@router.post("/v1/files")
async def create_file(
    request: Request,
    caller: CallerDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    """Upload a JSONL file (purpose ``batch``)."""
    gw = gateway_of(request)
    data = await file.read()
    obj = await gw.files.create(purpose, file.filename or "upload.jsonl", data)
    await _claim(gw, caller, obj.id)
    return obj.to_dict()


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str, caller: CallerDep) -> dict[str, Any]:
    """A file's metadata."""
    gw = gateway_of(request)
    await _own(gw, caller, "file", file_id)
    return (await gw.files.get(file_id)).to_dict()


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str, caller: CallerDep) -> Response:
    """A file's bytes (JSONL)."""
    gw = gateway_of(request)
    await _own(gw, caller, "file", file_id)
    return Response(await gw.files.content(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str, caller: CallerDep) -> dict[str, Any]:
    """Delete a file."""
    gw = gateway_of(request)
    await _own(gw, caller, "file", file_id)
    await gw.files.delete(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create_batch(request: Request, body: BatchBody, caller: CallerDep) -> dict[str, Any]:
    """Create a batch from an uploaded file; its lines run at priority ``batch``."""
    gw = gateway_of(request)
    await _own(gw, caller, "file", body.input_file_id)
    batch = await gw.batches.create(
        body.input_file_id,
        body.endpoint,
        body.completion_window,
        body.metadata,
        tenant=caller.key.tenant if caller.key is not None else DEFAULT_TENANT,
    )
    await _claim(gw, caller, batch.id)
    if batch.output_file_id:
        await _claim(gw, caller, batch.output_file_id)
    if batch.error_file_id:
        await _claim(gw, caller, batch.error_file_id)
    return batch.to_dict()


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str, caller: CallerDep) -> dict[str, Any]:
    """A batch: status, request_counts, output and error files once final."""
    gw = gateway_of(request)
    await _own(gw, caller, "batch", batch_id)
    batch = await gw.batches.get(batch_id)
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            await _claim(gw, caller, file_id)
    return batch.to_dict()


@router.get("/v1/batches")
async def list_batches(
    request: Request, caller: CallerDep, after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    """The batches, newest first, paginated with ``after`` and ``limit`` (1-100)."""
    gw = gateway_of(request)
    limit = max(1, min(100, limit))
    data: list[dict[str, Any]] = []
    cursor, has_more = after, True
    while len(data) < limit and has_more:
        page, has_more = await gw.batches.list(after=cursor, limit=limit)
        for batch in page:
            cursor = batch.id
            if caller.owner is not None:
                owner = as_str(await gw.client_redis.hget(gw.keys.owners, batch.id))
                if owner != caller.owner:
                    continue
            if len(data) < limit:
                data.append(batch.to_dict())
            else:
                has_more = True
                break
        if not page:
            has_more = False
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str, caller: CallerDep) -> dict[str, Any]:
    """Cancel: no new lines are fed, running ones are cancelled, what is done is kept."""
    gw = gateway_of(request)
    await _own(gw, caller, "batch", batch_id)
    return (await gw.batches.cancel(batch_id)).to_dict()
