"""Gradient compressors (GRACE's split): a method compresses, a memory feeds back its error.

The engines import nothing from here: the harness builds `CompressConfig(...).build()` and
hands them the two objects, which they use by shape (duck typing):

    compressor.name: str
    compressor.adds_up: bool             True: all-reduce the frames (a server may sum them);
                                         False: all-gather them, or the server decompresses each
    compressor.needs_error_feedback: bool
    compressor.compress(tensor, ctx) -> Message
    compressor.decompress(message) -> tensor    (the original shape and dtype)
    compressor.nbytes(message) -> int           bytes on the wire: every frame
                                                (values + indices + scales + packed bits)

    ctx = Context(step, key, rank)       step and key seed shared randomness (random-k's
                                         indices, PowerSGD's Q); rank seeds QSGD's own
    Message(frames, shape, dtype, header)  frames: tuple of tensors sent raw; header: small
                                         ints for a msgpack header (never pickled)

    memory.compensate(key, grad) -> grad + residual
    memory.remember(key, compensated, sent) stores compensated - sent, where `sent` is what
                                         the step applied for this worker's message (its
                                         decompressed message; for PowerSGD, the reduced
                                         approximation, as torch does)

PowerSGD needs a reduction between two halves: besides compress/decompress for the tensors
it leaves dense (`compresses(shape, step)` says which), it offers project / finish /
reconstruct; see experiments.compression.powersgd.

Methods: none, fp16, bf16 (casts.py), topk, randomk, sign, qsgd, powersgd, one module each.
"""

import importlib

from experiments.compression.config import CompressConfig

__all__ = ["CompressConfig", "Compressor", "Context", "ErrorFeedback", "Message", "sum_messages"]
_MODULES = {"Compressor": "base", "Context": "base", "Message": "base", "sum_messages": "base",
            "ErrorFeedback": "errorfeedback"}


def __getattr__(name: str):
    """The compressors' pieces import torch: each is imported when it is first asked for, so
    that reading a run's settings (CompressConfig) does not."""
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"experiments.compression.{_MODULES[name]}"), name)
