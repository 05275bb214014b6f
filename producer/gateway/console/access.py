"""Who may look at the console and who may act there.

With API keys off (``--auth off``, for local use) everyone who reaches the port may do both,
like the rest of the gateway. With keys on, a page needs a key whose role is ``viewer`` or
``admin`` (``auth.model.Role``; ``tokenfleet keys create --role``), and an action (cancel,
requeue, discard) an ``admin`` key; a ``user`` key is refused (it may see its own requests
only, through ``/v1``). The key comes as ``Authorization: Bearer`` or, for a browser, from the
``tf_console`` cookie the login form sets (HttpOnly, SameSite=Strict, the console's path only,
Secure over HTTPS).

Actions are POSTs that also need the ``HX-Request`` header (htmx sends it; a form or a link on
another site cannot), or a bearer key: a page elsewhere cannot make a logged-in browser act.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from tokenfleet.producer.gateway.auth import ApiKeyStore, Role
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.shared.errors import AuthError

COOKIE = "tf_console"
NEEDS_KEY = (
    "the console needs an API key with the viewer or admin role (tokenfleet keys create "
    "--role viewer): log in at /console/login or send it as 'Authorization: Bearer ...'"
)


@dataclass(frozen=True, slots=True)
class Visitor:
    """Who is looking: their key's name and role (``anyone`` with keys off)."""

    name: str
    role: Role
    by_cookie: bool = False

    @property
    def may_act(self) -> bool:
        """Whether the visitor may cancel, requeue and discard."""
        return self.role.allows(Role.ADMIN)


class ConsoleAccess:
    """Checks a request against the key store (None: keys are off)."""

    def __init__(self, store: ApiKeyStore | None) -> None:
        self.store = store

    @property
    def keys_on(self) -> bool:
        """Whether pages need a key."""
        return self.store is not None

    async def visitor(self, request: Request) -> Visitor:
        """The visitor of ``request`` (ApiError 401 without a usable key, 403 with a ``user``
        key)."""
        if self.store is None:
            return Visitor("anyone", Role.ADMIN)
        presented, by_cookie = _presented(request)
        if presented is None:
            raise ApiError(401, NEEDS_KEY, code="invalid_api_key")
        return await self.check(presented, by_cookie)

    async def check(self, presented: str, by_cookie: bool = False) -> Visitor:
        """The visitor a presented key makes (ApiError 401 / 403 as ``visitor``)."""
        if self.store is None:
            return Visitor("anyone", Role.ADMIN)
        try:
            key = await self.store.authenticate(presented)
        except AuthError as exc:
            raise ApiError(401, str(exc), code="invalid_api_key") from None
        if not key.role.allows(Role.VIEWER):
            raise ApiError(
                403,
                f"the API key {key.name} has the role {key.role.value}: the console needs "
                "viewer or admin",
                code="console_forbidden",
            )
        return Visitor(key.name, key.role, by_cookie)

    async def actor(self, request: Request) -> Visitor:
        """The visitor of an action (module docstring): 403 unless admin, and unless the
        request came from the console's own page (``HX-Request``) or with a bearer key."""
        visitor = await self.visitor(request)
        if not visitor.may_act:
            raise ApiError(
                403,
                f"the API key {visitor.name} may look, not act: cancel, requeue and discard "
                "need the admin role",
                code="console_forbidden",
            )
        if "hx-request" not in request.headers and not _bearer(request):
            raise ApiError(
                403,
                "console actions are sent by the console page (HX-Request) or with "
                "'Authorization: Bearer'",
                code="console_forbidden",
            )
        return visitor


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _presented(request: Request) -> tuple[str | None, bool]:
    bearer = _bearer(request)
    if bearer is not None:
        return bearer, False
    cookie = request.cookies.get(COOKIE)
    return (cookie, True) if cookie else (None, False)
