"""The C heap: handing freed pages back to the system. Standard library only (chat/ calls it
through the front door without loading torch)."""
from __future__ import annotations

import ctypes
import ctypes.util


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim, which first merges
    the free chunks; elsewhere nothing happens). Returns whether it could.

    Called where large temporaries were just freed: after a quantized model replaced its fp32
    weights (a quantized SmolLM2 engine kept ~190 MiB more without it: 873 -> 684 MiB), at the end
    of Engine.load (the tokenizer file's parse, ~50 MiB), after a refused document was read
    (chat/documents.py), and after each prefill (spotlight/generate.py:
    a chunk's activations; without it the next request's prefill finds them scattered in the heap,
    and an 8K Qwen2.5 prefill peaked ~80 MiB higher, docs/DECISIONS.md "Peak RSS at 8K, session 31")."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True
