"""The route tokenizer spec: what a producer needs to tokenize a prompt exactly as a worker of
the model does, so that it computes the engine's own block hashes (``prefix_chain``).

A worker publishes it once at start to ``Keys.route_tokenizer(model)`` (a hash of these
fields; rewritten only when its ``digest`` differs); producers read it when they first route a
request of the model and again when the digest changes. Fields (all strings):

* ``tokenizer``: the fast tokenizer's JSON (``tokenizers.Tokenizer.to_str()``);
* ``chat_template``: the model's Jinja chat template ("" for none);
* ``special``: JSON object of the template's special-token variables (``bos_token``, ...);
* ``block_size``: the engine's KV block size in tokens (decimal);
* ``digest``: SHA-256 of the other four (hex).

Workers of one model must use one tokenizer and one block size (they serve the same model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

FIELDS = ("tokenizer", "chat_template", "special", "block_size")


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """One model's route tokenizer spec (module doc)."""

    tokenizer: str
    chat_template: str
    special: Mapping[str, str]
    block_size: int

    @property
    def digest(self) -> str:
        """SHA-256 of the fields, hex: equal digests, equal tokenization."""
        h = hashlib.sha256()
        for name, value in zip(FIELDS, self._texts(), strict=True):
            h.update(name.encode() + b"\0" + value.encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()

    def _texts(self) -> tuple[str, str, str, str]:
        special = orjson.dumps(dict(self.special), option=orjson.OPT_SORT_KEYS).decode()
        return self.tokenizer, self.chat_template, special, str(self.block_size)

    def to_hash(self) -> dict[str, str]:
        """The Redis hash's fields."""
        return {**dict(zip(FIELDS, self._texts(), strict=True)), "digest": self.digest}

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> RouteSpec | None:
        """The spec a hash holds; None if it is missing a field or is malformed."""
        try:
            text = {k.decode(): v.decode("utf-8", "surrogatepass") for k, v in raw.items()}
            special = orjson.loads(text["special"])
            if not isinstance(special, dict):
                return None
            spec = cls(
                text["tokenizer"],
                text["chat_template"],
                {str(k): str(v) for k, v in special.items()},
                int(text["block_size"]),
            )
        except (KeyError, ValueError, UnicodeDecodeError, orjson.JSONDecodeError):
            return None
        if spec.block_size < 1 or text.get("digest") != spec.digest:
            return None
        return spec
