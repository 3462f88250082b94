"""Decoding the router's request bodies: whole, or every field but a chat request's messages."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["decode_all_but_messages", "decode_body"]

_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a dict ({} when it is not a JSON object: forwarded unchanged, the engine reports it)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        body = None
    return body if isinstance(body, dict) else {}


def decode_all_but_messages(raw: bytes) -> tuple[dict[str, Any], bytes] | None:
    """A chat body's fields but ``messages``, decoded, and the messages' JSON text (None: not such a body).

    One pass over the body finds every field's bytes (``msgspec.Raw``); the
    messages stay bytes, for :meth:`kvindex.tokenize.RequestTokenizer.tokenize_warm`.
    """
    try:
        fields = _FIELDS.decode(raw)
        enc = fields.pop("messages", None)
        if enc is None:
            return None
        return {k: msgspec.json.decode(v) for k, v in fields.items()}, bytes(enc)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
