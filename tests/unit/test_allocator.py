"""ps/allocator.py: after keep_freed_pages, a freed 8 MiB buffer stays in the heap (glibc's
default gives it back to the kernel), and the call is made once per process."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from ps import allocator

# In a fresh interpreter: malloc 8 MiB, touch it, free it, and print the free bytes the
# heap still holds (mallinfo2's fordblks) and keep_freed_pages's answer where asked.
_PROBE = """
import ctypes, ctypes.util, sys
from ps.allocator import keep_freed_pages
kept = keep_freed_pages() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
p = libc.malloc(8 << 20)
ctypes.memset(p, 1, 8 << 20)
libc.free(p)
print(kept, libc.mallinfo2().fordblks)
"""


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2")
    except OSError:
        return False


def _probe(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    kept, free_bytes = out.stdout.split()
    return kept, int(free_bytes)


@pytest.mark.skipif(not _glibc(), reason="glibc's mallinfo2 reads the heap")
def test_a_freed_buffer_stays_in_the_heap():
    kept, free_bytes = _probe("keep")
    assert kept == "True"
    assert free_bytes >= 8 << 20  # still the process's: the next message of this size reuses it
    _, default_free = _probe("default")
    assert default_free < 8 << 20  # glibc's default: a mapping of its own, unmapped on free


def test_the_settings_are_made_once(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_set", lambda: calls.append(1) or True)
    assert allocator.keep_freed_pages() and allocator.keep_freed_pages()
    assert calls == [1]
