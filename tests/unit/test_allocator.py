"""ps/allocator.py: after keep_freed_pages, a freed buffer of any size stays in the heap,
whichever thread allocated it (glibc's default maps one above its threshold, or above 64 MiB
in a thread's own arena, and unmaps it on free), and the call is made once per process."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from ps import allocator

# In a fresh interpreter: malloc SIZE bytes (in a thread of its own where asked), touch
# them, free them, and print keep_freed_pages's answer where asked and the free bytes the
# heaps still hold (mallinfo2's fordblks, summed over every arena).
_PROBE = """
import ctypes, ctypes.util, sys, threading
from ps.allocator import keep_freed_pages
kept = keep_freed_pages() if sys.argv[1] == "keep" else None
size, where = int(sys.argv[2]), sys.argv[3]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
def use():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
if where == "thread":
    t = threading.Thread(target=use)
    t.start()
    t.join()
else:
    use()
print(kept, libc.mallinfo2().fordblks)
"""


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2")
    except OSError:
        return False


def _probe(mode: str, size: int, where: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, str(size), where],
                         capture_output=True, text=True, timeout=60, check=True)
    kept, free_bytes = out.stdout.split()
    return kept, int(free_bytes)


@pytest.mark.skipif(not _glibc(), reason="glibc's mallinfo2 reads the heap")
@pytest.mark.parametrize("size, where", [(8 << 20, "main"), (48 << 20, "main"), (96 << 20, "thread")])
def test_a_freed_buffer_stays_in_the_heap(size, where):
    kept, free_bytes = _probe("keep", size, where)
    assert kept == "True"
    assert free_bytes >= size  # still the process's: the next buffer of this size reuses its pages
    _, default_free = _probe("default", size, where)
    assert default_free < size  # glibc's default: a mapping of its own, unmapped on free


def test_the_settings_are_made_once(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_set", lambda: calls.append(1) or True)
    assert allocator.keep_freed_pages() and allocator.keep_freed_pages()
    assert calls == [1]
