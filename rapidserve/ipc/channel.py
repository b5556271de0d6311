"""Typed channels: msgspec-encoded messages of declared types over a `ShmRing`.

Messages are `msgspec.Struct` classes declared with ``tag=True`` so that a receiver declared with
several types gets back an instance of the right one. Encoding is msgpack; nothing is pickled.

    class NewRequest(msgspec.Struct, tag=True): ...
    class Abort(msgspec.Struct, tag=True): ...
    tx: Sender[NewRequest | Abort] = Sender(ring, (NewRequest, Abort))
    rx: Receiver[NewRequest | Abort] = Receiver(ShmRing.attach(ring.name), (NewRequest, Abort))
"""

from __future__ import annotations

import functools
import operator
import types as types_mod
import typing
from typing import Any, Generic, TypeVar, Union

import msgspec

from rapidserve.ipc.ring import ShmRing

T = TypeVar("T")
MessageTypes = Any  # a Struct class, a tuple/list of them, or a Union of them


def _classes(types: MessageTypes) -> tuple[type, ...]:
    """The declared message classes, from a class, a tuple/list of classes or a Union."""
    if isinstance(types, (tuple, list)):
        classes = tuple(types)
    elif typing.get_origin(types) in (Union, types_mod.UnionType):
        classes = typing.get_args(types)
    else:
        classes = (types,)
    if not classes or not all(isinstance(c, type) for c in classes):
        raise TypeError(f"message types must be classes (msgspec Structs), got {types!r}")
    return classes


class Sender(Generic[T]):
    """Writing end of a typed channel; `send` refuses objects that are not of a declared type."""

    def __init__(self, ring: ShmRing, types: MessageTypes) -> None:
        self.ring = ring
        self._classes = _classes(types)
        self._encode = msgspec.msgpack.Encoder().encode

    def send(self, msg: T, timeout: float | None = None) -> None:
        """Encode and publish; waits for room up to `timeout` s (None: forever), else `RingFull`."""
        if not isinstance(msg, self._classes):
            raise TypeError(f"{type(msg).__name__} is not one of this channel's message types "
                            f"({', '.join(c.__name__ for c in self._classes)})")
        self.ring.put(self._encode(msg), timeout)

    def try_send(self, msg: T) -> bool:
        """Publish without waiting; False if the ring has no room now."""
        try:
            self.send(msg, timeout=0)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.ring.close()


class Receiver(Generic[T]):
    """Reading end of a typed channel: returns decoded, typed message objects.

    A message that is not one of the declared types raises `msgspec.ValidationError` (it is
    consumed); `RingClosed` comes from the ring once it is closed and empty.
    """

    def __init__(self, ring: ShmRing, types: MessageTypes) -> None:
        self.ring = ring
        classes = _classes(types)
        self._decode = msgspec.msgpack.Decoder(functools.reduce(operator.or_, classes)).decode

    def recv(self, timeout: float | None = None) -> T | None:
        """Next message, waiting up to `timeout` s (None: forever); None on timeout."""
        data = self.ring.get(timeout)
        return None if data is None else self._decode(data)

    def try_recv(self) -> T | None:
        """Next message if one is available now, else None."""
        data = self.ring.try_get()
        return None if data is None else self._decode(data)

    def drain(self, max_items: int = 1 << 30) -> list[T]:
        """Every message available now (at most `max_items`), without blocking."""
        decode = self._decode
        return [decode(data) for data in self.ring.drain(max_items)]

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a message is available (True) or `timeout` s pass (False)."""
        return self.ring.wait(timeout)

    def close(self) -> None:
        self.ring.close()
