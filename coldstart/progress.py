"""How long operations report progress by bytes, without knowing who draws it.

A library function that moves many bytes (convert a layer, download a blob, upload a model)
takes an optional :class:`ByteProgress` and calls ``expect(n)`` as it learns of work and
``advance(phase, n)`` as bytes pass through a phase (``"download"``, ``"convert"``, ``"upload"``,
…); each phase's total is everything expected. The CLI draws it (rich, on a terminal); tests
count it.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ByteProgress"]


class ByteProgress(Protocol):
    def expect(self, n: int) -> None:
        """``n`` more bytes will pass through every phase."""

    def advance(self, phase: str, n: int) -> None:
        """``n`` more bytes passed through ``phase``."""
