"""tar-split records (vbatts/tar-split's NDJSON) that let a reader rebuild the exact tar stream.

containers/storage stores them with a zstd:chunked layer so that a layer pulled file by file can
be exported again byte for byte. Type 2 records carry raw tar bytes (headers, padding, the
end-of-archive blocks); type 1 records stand for a file's contents (name and size).
"""

from __future__ import annotations

import base64
import json

__all__ = ["TarSplitWriter"]


class TarSplitWriter:
    """Accumulates tar-split records in memory (a few hundred bytes per tar entry)."""

    def __init__(self) -> None:
        self._lines: list[bytes] = []
        self._pos = 0

    def segment(self, raw: bytes) -> None:
        """Raw tar bytes that are not file contents."""
        if not raw:
            return
        rec = {"type": 2, "payload": base64.b64encode(raw).decode("ascii"), "position": self._pos}
        self._add(rec)

    def file(self, name: str, size: int) -> None:
        """A file's contents: ``size`` bytes, rebuilt from the file ``name``.

        The CRC-64 payload that tar-split can carry is left out (pure-Python CRC-64 would
        cost more than the whole conversion).
        """
        self._add({"type": 1, "name": name, "size": size, "position": self._pos})

    def _add(self, rec: dict[str, object]) -> None:
        self._lines.append(json.dumps(rec, ensure_ascii=True, separators=(",", ":")).encode())
        self._pos += 1

    def getvalue(self) -> bytes:
        """The NDJSON document."""
        return b"".join(line + b"\n" for line in self._lines)
