"""The gateway's OpenAPI schema is pinned: ``openapi.json`` beside this file is what
``create_app(...).openapi()`` returned when it was written. A change to the HTTP surface is then a
deliberate one: regenerate the snapshot with the command the failure prints, and review its diff.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenfleet.producer.gateway.app import create_app
from tokenfleet.producer.gateway.settings import GatewaySettings
from tokenfleet.shared.settings import Settings

SNAPSHOT = Path(__file__).with_name("openapi.json")
REGENERATE = (
    '.venv/bin/python -c "import json; from tokenfleet.producer.gateway.app import create_app; '
    "from tokenfleet.producer.gateway.settings import GatewaySettings; "
    "from tokenfleet.shared.settings import Settings; "
    "print(json.dumps(create_app(Settings(), GatewaySettings()).openapi(), indent=1, "
    f'sort_keys=True))" > {SNAPSHOT.relative_to(Path(__file__).parents[2])}'
)


@pytest.mark.parametrize("auth", ["off", "required"])
def test_openapi_schema_is_unchanged(auth: str) -> None:
    schema = create_app(Settings(), GatewaySettings(auth=auth)).openapi()
    pinned = json.loads(SNAPSHOT.read_text())
    assert schema == pinned, f"the gateway's OpenAPI schema changed; if on purpose: {REGENERATE}"
    assert schema["paths"], "an empty schema cannot pin anything"
