"""Write ``metadata.json`` the way docs/format.md §3.5 says, for tests that craft or edit one.

A v2 document ends with ``,"metadata_checksum":"<16 hex>"}``: the XXH3-64 of every byte before
that member. Tests that change a field on purpose re-seal the document, so that the check
they aim at (not the checksum) is the one that fires.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xxhash


def seal(doc: dict[str, Any]) -> bytes:
    """The JSON bytes of ``doc`` (v2: with its metadata_checksum, replacing any it had)."""
    body = {k: v for k, v in doc.items() if k != "metadata_checksum"}
    raw = json.dumps(body, separators=(",", ":")).encode()
    if body.get("format_version", 0) < 2:
        return raw
    head = raw[:-1]
    return head + b',"metadata_checksum":"' + f"{xxhash.xxh3_64_intdigest(head):016x}".encode() + b'"}'


_TRAILER = re.compile(rb'\s*,\s*"metadata_checksum"\s*:\s*"[^"]*"\s*\}\s*\Z')


def reseal(raw: bytes) -> bytes:
    """Raw metadata text edited on purpose, with its metadata_checksum made valid again (a
    document without one, such as v1, is returned as it is)."""
    m = _TRAILER.search(raw)
    if m is None:
        return raw
    head = raw[: m.start()]
    return head + b',"metadata_checksum":"' + f"{xxhash.xxh3_64_intdigest(head):016x}".encode() + b'"}'
