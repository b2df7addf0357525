"""Transports move (metadata, tensor) messages between ranks. See base.py for the contract."""
from runtime.transport.base import Arrival, Transport

__all__ = ["Arrival", "Transport"]
