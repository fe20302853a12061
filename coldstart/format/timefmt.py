"""RFC 3339 timestamps as Go's encoding/json writes them, to and from integer nanoseconds."""

from __future__ import annotations

import datetime as _dt
import re

from coldstart.errors import FormatError

__all__ = ["format_rfc3339", "parse_rfc3339"]

_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))\Z"
)
_EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()
_NS = 1_000_000_000


def parse_rfc3339(text: str, *, what: str = "modtime") -> int:
    """Nanoseconds since the Unix epoch for an RFC 3339 time (Go's zero time is accepted).

    >>> parse_rfc3339("1970-01-01T00:00:01.5Z")
    1500000000
    """
    m = _RFC3339.match(text)
    if m is None:
        raise FormatError(f"{what} {text[:64]!r} is not an RFC 3339 time")
    year, month, day, hh, mm, ss = (int(m.group(i)) for i in range(1, 7))
    try:
        ordinal = _dt.date(year, month, day).toordinal()
    except ValueError as exc:
        raise FormatError(f"{what} {text!r}: {exc}") from None
    if hh > 23 or mm > 59 or ss > 60:
        raise FormatError(f"{what} {text!r}: time of day out of range")
    frac = m.group(7) or ""
    ns = int(frac.ljust(9, "0")) if frac else 0
    secs = (ordinal - _EPOCH_ORDINAL) * 86400 + hh * 3600 + mm * 60 + ss
    if m.group(9):
        off = int(m.group(10)) * 3600 + int(m.group(11)) * 60
        secs -= off if m.group(9) == "+" else -off
    return secs * _NS + ns


def format_rfc3339(ns: int) -> str:
    """Format nanoseconds since the epoch as RFC 3339 UTC (``Z``), like Go's time.Time.

    >>> format_rfc3339(1500000000)
    '1970-01-01T00:00:01.5Z'
    """
    secs, frac = divmod(ns, _NS)
    days, rem = divmod(secs, 86400)
    try:
        date = _dt.date.fromordinal(days + _EPOCH_ORDINAL)
    except (ValueError, OverflowError):
        raise FormatError(f"time {ns} ns since the epoch is outside years 1..9999") from None
    hh, rem = divmod(rem, 3600)
    mm, ss = divmod(rem, 60)
    out = f"{date.year:04d}-{date.month:02d}-{date.day:02d}T{hh:02d}:{mm:02d}:{ss:02d}"
    if frac:
        out += "." + f"{frac:09d}".rstrip("0")
    return out + "Z"
