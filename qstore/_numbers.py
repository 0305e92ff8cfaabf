"""Numbers written as text: the one rule the command line and the backfill share."""

from __future__ import annotations


def plain_number(text: str) -> str:
    """``text`` stripped, for int() or float(), if it is written in ASCII without
    underscores: Python's readers also take ``"1_000"`` and other scripts' digits,
    which no CSV or JSON writer, nor anyone typing a command, means as a number;
    ValueError otherwise."""
    text = text.strip()
    if not text.isascii() or "_" in text:
        raise ValueError(text)
    return text
