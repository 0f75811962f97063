"""Wire compression of gradients: the dtype a bucket travels in."""

from __future__ import annotations

import torch

WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype(name: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to send a `dtype` gradient in under compression `name`, or None for as-is."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"compression {name!r}: expected one of {', '.join(WIRE_DTYPES)}")
    wire = WIRE_DTYPES[name]
    return None if wire is None or wire == dtype else wire
