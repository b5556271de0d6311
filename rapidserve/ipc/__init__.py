"""Inter-process channels: SPSC shared-memory rings carrying msgspec-encoded messages."""

from rapidserve.ipc.channel import Receiver, Sender
from rapidserve.ipc.doorbell import DOORBELL_NAME_MAX, Doorbell, doorbell_name, wait_any
from rapidserve.ipc.ring import (
    MessageTooLarge,
    RingClosed,
    RingError,
    RingFull,
    RingLayoutError,
    ShmRing,
    cleanup_stale,
    new_engine_id,
    pid_alive,
    ring_name,
)

__all__ = [
    "DOORBELL_NAME_MAX",
    "Doorbell",
    "MessageTooLarge",
    "Receiver",
    "RingClosed",
    "RingError",
    "RingFull",
    "RingLayoutError",
    "Sender",
    "ShmRing",
    "cleanup_stale",
    "doorbell_name",
    "new_engine_id",
    "pid_alive",
    "ring_name",
    "wait_any",
]
