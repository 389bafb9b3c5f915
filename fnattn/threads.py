"""How many CPU threads torch uses: FNATTN_THREADS, else half the cores this process may run on.

torch starts one intra-op thread per core it sees. A step of a small model is
many small ops, and with every core busy each op's threads wait for one
another: on two cores shared with other work a tiny decode step took 41.8 ms
with two threads and 3.7 ms with one. Half the usable cores (at least one)
leaves room for the host thread, the interpreter and neighbours, and keeps to
one thread per physical core where cores are hyper-threaded pairs.

Applied by the command-line entry points (``fnattn demo``, ``generate``,
``bench``), never at import: a library must not change its host's threads.
"""

from __future__ import annotations

import os

ENV = "FNATTN_THREADS"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_count(environ=os.environ) -> int:
    """FNATTN_THREADS when set (a positive int, else ``ValueError`` naming it), else half the usable cores."""
    text = environ.get(ENV)
    if text is None or not text.strip():
        return max(1, usable_cores() // 2)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}: must be a positive int (threads for torch on CPU), got {text!r}")
    return n


def apply_thread_policy(environ=os.environ) -> int:
    """``torch.set_num_threads(thread_count())``; ``-> the count``."""
    import torch

    n = thread_count(environ)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
