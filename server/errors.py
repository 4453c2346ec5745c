"""What a request can be refused with, below the HTTP edge: a code of the design's error table and a message."""

from __future__ import annotations


class Refused(Exception):
    code = "refused"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
