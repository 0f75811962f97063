"""libzmq's functions for psar's compiled modules (ps/_zmq.h): the worker's lane
(ps._client) and a shard's sender (ps._send) call the libzmq that pyzmq calls, on pyzmq's own
sockets. Each module is given the functions' addresses once (its link())."""

from __future__ import annotations

import ctypes
import importlib
import os
from typing import Any

FUNCTIONS = ("zmq_send", "zmq_msg_init", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more",
             "zmq_msg_close", "zmq_poll", "zmq_errno", "zmq_msg_init_data", "zmq_msg_send")
"""In the order ps/_zmq.h's link() takes them."""

_linked: dict[int, bool] = {}


def compiled_on() -> bool:
    """Whether the compiled paths are on (PSAR_COMPILED=0 turns them all off: a comparison)."""
    return os.environ.get("PSAR_COMPILED", "1") != "0"


def linked(module: Any) -> bool:
    """Whether module (a compiled module of psar, or None: not built) has libzmq's functions,
    as pyzmq's compiled module links them, given once: ctypes looks them up from that module's
    handle, in it and in the libraries it loaded (the libzmq it calls, not another one some
    other module may have loaded); False where that module does not say."""
    if module is None:
        return False
    done = _linked.get(id(module))
    if done is None:
        try:
            backend = importlib.import_module("zmq.backend.cython._zmq")
            lib = ctypes.CDLL(backend.__file__)  # loaded already: dlopen gives its handle
            module.link(tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in FUNCTIONS))
            done = True
        except (ImportError, OSError, AttributeError, ValueError, TypeError):
            done = False
        _linked[id(module)] = done
    return done
