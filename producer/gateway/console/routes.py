"""The console's HTTP surface under ``/console`` (docs/console.md):

* ``GET /console``: the page; ``GET /console/events``: its live feed (SSE: one event per table,
  an HTML fragment each, swapped in by htmx; ``history`` carries the sparklines' data as JSON);
  ``GET /console/status.json``: the same snapshot as JSON;
* ``GET /console/requests/{id}``: a request's page; ``.../events``: its tokens as they come
  (from the durable record, then its channel: ``AsyncHandle.stream``), then its record again;
* ``POST /console/requests/{id}/cancel``, ``POST /console/dead/requeue`` and
  ``POST /console/dead/discard`` (``lane``, ``entry``): the actions (``access``);
* ``GET|POST /console/login``, ``POST /console/logout``; ``/console/static/...``: the page's
  scripts and styles, served from the package (nothing from elsewhere: it works offline).

Every page is sent with a Content-Security-Policy that lets only the console's own scripts run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from markupsafe import Markup, escape
from sse_starlette import EventSourceResponse, ServerSentEvent

from tokenfleet.producer.gateway.console.access import COOKIE, ConsoleAccess, Visitor
from tokenfleet.producer.gateway.console.live import LiveFeed, Reading
from tokenfleet.producer.gateway.console.render import FRAGMENTS, fragment
from tokenfleet.producer.gateway.console.view import ConsoleData, request_text
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.keepalive import event_stream
from tokenfleet.shared.errors import InvalidRequest, TokenfleetError, UnknownRequest
from tokenfleet.shared.keys import check_request_id
from tokenfleet.shared.schema import TerminalEvent, TokenEvent

router = APIRouter(prefix="/console", include_in_schema=False)
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


class Console:
    """What the routes share, one per app: the data, the live feed, access, the templates.

    A reading is rendered once for every console open on the process (per kind of visitor:
    one who may act sees the action buttons), not once per console: ``rendered`` keeps the
    last reading's events."""

    def __init__(
        self,
        data: ConsoleData,
        access: ConsoleAccess,
        env: Any,
        *,
        refresh_s: float,
        keepalive_s: float,
    ) -> None:
        self.data = data
        self.access = access
        self.env = env
        self.feed = LiveFeed(data.snapshot, refresh_s)
        self.keepalive_s = keepalive_s  # the gateway's SSE keep-alive (``keepalive``)
        self._rendered: dict[bool, tuple[int, list[ServerSentEvent]]] = {}

    def rendered(self, reading: Reading, visitor: Visitor) -> list[ServerSentEvent]:
        """The events of ``reading`` for ``visitor`` (each table's HTML, the sparklines')."""
        cached = self._rendered.get(visitor.may_act)
        if cached is not None and cached[0] == reading.number:
            return cached[1]
        if reading.snapshot is None:
            events = [ServerSentEvent(_alert(reading.error), event="alert")]
        else:
            events = [ServerSentEvent("", event="alert")]
            for name, html in self.fragments(reading.snapshot, visitor).items():
                events.append(ServerSentEvent(html, event=name))
            history = orjson.dumps(self.feed.series()).decode()
            events.append(ServerSentEvent(history, event="history"))
        self._rendered[visitor.may_act] = (reading.number, events)
        return events

    def page(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        html = self.env.get_template(name).render(keys_on=self.access.keys_on, **context)
        return HTMLResponse(html, status_code=status, headers={"Content-Security-Policy": CSP})

    def fragments(self, snapshot: dict[str, Any], visitor: Visitor) -> dict[str, Markup]:
        """Each table's HTML (the API keys' only when keys are on: the page has no such table
        otherwise)."""
        context = {**snapshot, "visitor": visitor}
        names = [n for n in FRAGMENTS if n != "keys" or self.access.keys_on]
        return {name: fragment(self.env, name, context) for name in names}


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


async def _visitor_or_login(request: Request) -> Visitor | HTMLResponse:
    console = console_of(request)
    try:
        return await console.access.visitor(request)
    except ApiError as exc:
        return console.page("login.html", exc.status, message=exc.message, visitor=None)


@router.get("")
async def page(request: Request) -> Response:
    """The console: every table, filled now, then kept live by ``/console/events``."""
    visitor = await _visitor_or_login(request)
    if isinstance(visitor, HTMLResponse):
        return visitor
    console = console_of(request)
    snapshot = await console.data.snapshot()
    return console.page(
        "console.html",
        visitor=visitor,
        parts=console.fragments(snapshot, visitor),
        refresh_s=console.feed.refresh_s,
    )


@router.get("/status.json")
async def status_json(request: Request) -> Response:
    """The snapshot the page shows, as JSON (the fleet part is ``fleet_status()``'s)."""
    console = console_of(request)
    await console.access.visitor(request)
    return Response(orjson.dumps(await console.data.snapshot()), media_type="application/json")


@router.get("/events")
async def events(request: Request) -> EventSourceResponse:
    """The live feed: every ``refresh_s``, each table's fragment and the sparklines' data."""
    console = console_of(request)
    visitor = await console.access.visitor(request)

    async def feed() -> AsyncIterator[ServerSentEvent]:
        async for reading in console.feed.listen():
            for event in console.rendered(reading, visitor):
                yield event

    return event_stream(
        feed(), keepalive_s=console.keepalive_s, headers={"Cache-Control": "no-store"}
    )


def _alert(message: str) -> str:
    return f'<p class="alert">{escape(message)}</p>'


@router.get("/requests")
async def find_request(request: Request, id: str = "") -> Response:
    """The search box: to the request's page."""
    rid = id.strip()
    try:
        check_request_id(rid)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="id") from None
    return RedirectResponse(f"/console/requests/{rid}", status_code=303)


@router.get("/requests/{request_id}")
async def request_page(request: Request, request_id: str) -> Response:
    """One request: its record, its prompt while its queue entry exists, its tokens live."""
    visitor = await _visitor_or_login(request)
    if isinstance(visitor, HTMLResponse):
        return visitor
    console = console_of(request)
    try:
        check_request_id(request_id)
        record, payload = await console.data.request(request_id)
    except (InvalidRequest, UnknownRequest) as exc:
        return console.page(
            "missing.html", 404, visitor=visitor, request_id=request_id, message=str(exc)
        )
    return console.page(
        "request.html",
        visitor=visitor,
        record=record.to_dict(),
        prompt=request_text(payload) if payload is not None else None,
        record_html=fragment(console.env, "record", {"record": record.to_dict()}),
    )


@router.get("/requests/{request_id}/events")
async def request_events(request: Request, request_id: str) -> EventSourceResponse:
    """The request's tokens as ``token`` events (escaped text), from its first; its record as
    ``record`` when it ends; ``end`` last."""
    console = console_of(request)
    await console.access.visitor(request)
    check_request_id(request_id)
    handle = console.data.client.handle(request_id)

    async def feed() -> AsyncIterator[ServerSentEvent]:
        try:
            async for event in handle.stream(0):
                if isinstance(event, TokenEvent):
                    yield ServerSentEvent(
                        f'<span class="tok">{escape(event.text)}</span>',
                        event="token",
                        id=str(event.index),
                    )
                elif isinstance(event, TerminalEvent):
                    break
        except TokenfleetError as exc:
            yield ServerSentEvent(_alert(str(exc)), event="alert")
        finally:
            handle.close()
        try:
            record, _ = await console.data.request(request_id)
            html = fragment(console.env, "record", {"record": record.to_dict()})
            yield ServerSentEvent(html, event="record")
        except UnknownRequest:
            pass
        yield ServerSentEvent("ended", event="end")

    return event_stream(
        feed(), keepalive_s=console.keepalive_s, headers={"Cache-Control": "no-store"}
    )


@router.post("/requests/{request_id}/cancel")
async def cancel(request: Request, request_id: str) -> HTMLResponse:
    """Cancel a request (admin): its waiting entry ends now, a running one at its worker's
    next step."""
    console = console_of(request)
    await console.access.actor(request)
    try:
        check_request_id(request_id)
        cancelled = await console.data.client.cancel(request_id)
    except (InvalidRequest, UnknownRequest) as exc:
        return _note(str(exc), 404)
    return _note("cancelled" if cancelled else "it had already ended")


@router.post("/dead/requeue")
async def requeue(
    request: Request, lane: Annotated[str, Form()] = "", entry: Annotated[str, Form()] = ""
) -> HTMLResponse:
    """Run a dead letter again as a new request (admin); the row says as which."""
    console = console_of(request)
    await console.access.actor(request)
    try:
        new_id = await console.data.requeue(lane, entry)
    except TokenfleetError as exc:
        return _note(f"not requeued: {exc}", 409)
    link = f'<a href="/console/requests/{escape(new_id)}">{escape(new_id)}</a>'
    return HTMLResponse(f'<span class="note ok">requeued as {link}</span>')


@router.post("/dead/discard")
async def discard(
    request: Request, lane: Annotated[str, Form()] = "", entry: Annotated[str, Form()] = ""
) -> HTMLResponse:
    """Delete a dead letter (admin)."""
    console = console_of(request)
    await console.access.actor(request)
    found = await console.data.discard(lane, entry)
    return _note("discarded" if found else "already gone")


def _note(text: str, status: int = 200) -> HTMLResponse:
    kind = "ok" if status == 200 else "bad"
    return HTMLResponse(f'<span class="note {kind}">{escape(text)}</span>', status_code=status)


@router.get("/login")
async def login_page(request: Request) -> HTMLResponse:
    """The key form."""
    return console_of(request).page("login.html", message="", visitor=None)


@router.post("/login")
async def login(request: Request, key: Annotated[str, Form()] = "") -> Response:
    """Check the key (viewer or admin), keep it in the console's cookie, go to the console."""
    console = console_of(request)
    try:
        await console.access.check(key.strip(), by_cookie=True)
    except ApiError as exc:
        return console.page("login.html", exc.status, message=exc.message, visitor=None)
    response = RedirectResponse("/console", status_code=303)
    response.set_cookie(
        COOKIE,
        key.strip(),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/console",
    )
    return response


@router.post("/logout")
async def logout() -> Response:
    """Forget the key."""
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(COOKIE, path="/console")
    return response
