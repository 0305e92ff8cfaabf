"""What batch and receipt arguments must be: shared by the embedded queue and both clients."""

from __future__ import annotations

from ._errors import InvalidArgument


def refuse_single_item(items: object, what: str) -> None:
    """A str or bytes given where a batch goes is one item, not a batch: iterated, its
    characters or bytes became the items (``push_many(b"abc")`` said "not 97",
    ``ack_many(receipt)`` "malformed receipt '1'"; an API audit)."""
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{what} takes an iterable of items, not one "
                              f"{type(items).__name__}: put it in a list")


def no_receipt(message_id: int) -> InvalidArgument:
    """The error for a Message from peek, get or dead_letters given where a receipt
    goes (it said "expected a Message from pop() or its receipt, not Message(...)")."""
    return InvalidArgument(f"message {message_id} has no receipt: only a Message from pop() "
                           "(or extend()) is leased to you")
