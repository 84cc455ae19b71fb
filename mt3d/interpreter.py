"""Mends for bugs of the running Python interpreter (a base module: ``mt3d/__init__`` applies them).

Python before 3.12: an import made inside another import's module-lock wait breaks the outer one
(CPython gh-91351, fixed in 3.12 by PR 94504, not backported). ``_ModuleLock.acquire`` records "this
thread waits on lock L" in ``importlib._bootstrap._blocking_on[thread]`` and deletes that entry when
it is done. Code that runs asynchronously in the same thread during the wait (a finalizer run by the
garbage collector, a signal handler) and imports a module makes a nested ``acquire``, which deletes
the same entry; the outer one's delete then raises ``KeyError: <thread id>`` out of the ``import``
statement. Seen in CI: DeepSpeed's engine constructor imports ``fairseq`` (absent, so the slow path
with a module lock, on every engine), and the KeyError came out of it on both ranks of a test that
builds several engines in one process: most likely a collection during that wait ran finalizers of the
previous run's objects that import (the log does not show the nested import itself).

The mend replaces ``acquire`` with the same algorithm that restores the entry it found instead of
deleting it. tests/test_codebase.py reproduces the bug deterministically (a signal handler importing
while the main thread waits on a module lock another thread holds) and checks both that the
interpreter still has it (so the mend is still needed) and that the mend removes it.
"""

from __future__ import annotations

import sys

NEEDS_REENTRANT_IMPORTS = sys.version_info < (3, 12)


def mend_reentrant_imports() -> bool:
    """Make module-lock waits survive a nested import in the same thread; True if applied now."""
    if not NEEDS_REENTRANT_IMPORTS:
        return False
    import _thread
    import importlib._bootstrap as importlib_bootstrap

    lock_class = importlib_bootstrap._ModuleLock
    if getattr(lock_class.acquire, "_mt3d_mended", False):
        return False

    def acquire(self):
        tid = _thread.get_ident()
        blocking_on = importlib_bootstrap._blocking_on
        outer = blocking_on.get(tid)  # a wait this one interrupted (finalizer, signal handler)
        blocking_on[tid] = self
        try:
            while True:
                with self.lock:
                    if self.count == 0 or self.owner == tid:
                        self.owner = tid
                        self.count += 1
                        return True
                    if self.has_deadlock():
                        raise importlib_bootstrap._DeadlockError(f"deadlock detected by {self!r}")
                    if self.wakeup.acquire(False):
                        self.waiters += 1
                self.wakeup.acquire()  # wait for a release()
                self.wakeup.release()
        finally:
            if outer is None:
                blocking_on.pop(tid, None)
            else:
                blocking_on[tid] = outer

    acquire._mt3d_mended = True
    acquire.__doc__ = lock_class.acquire.__doc__
    lock_class.acquire = acquire
    return True
