"""moto's S3 server, with ranged GETs that read only their range (for bench_object_store.py).

moto answers a GET by copying the whole object (``FakeKey.value``) and then slicing out the
requested range, so each ranged GET costs time in proportion to the object, not the range. A
real store does not behave like that, and it would favour whichever client makes fewer,
larger requests. Here, while a GET with a ``Range`` header is served, ``FakeKey.value`` is a
view that reads only the slice the range handler takes. Same arguments as ``moto_server``.
"""

from __future__ import annotations

import sys
import threading

from moto.s3 import responses
from moto.s3.models import FakeKey

_ranged = threading.local()
_value = FakeKey.value


class _RangeView:
    """``len()`` and one slice of a key's bytes, read from its buffer under its lock."""

    def __init__(self, key: FakeKey) -> None:
        self._key = key

    def __len__(self) -> int:
        return self._key.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(self._key.size)
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return self._key._value_buffer.read(max(0, stop - start))


def _value_or_view(self: FakeKey):
    return _RangeView(self) if getattr(_ranged, "on", False) else _value.fget(self)


_get_object = responses.S3Response.get_object


def get_object(self):
    _ranged.on = bool(self.headers.get("range"))
    try:
        status, headers, content = _get_object(self)
    finally:
        _ranged.on = False
    if isinstance(content, _RangeView) and status == 200:
        return status, headers, content  # sliced by the range handler
    return status, headers, content


FakeKey.value = property(_value_or_view, _value.fset)
responses.S3Response.get_object = get_object

if __name__ == "__main__":
    from moto.server import main

    sys.exit(main())
