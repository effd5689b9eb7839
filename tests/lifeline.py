"""Helper processes of a test that end once the test's process is gone.

A test that starts a process to run until the test kills it (a CPU hog beside the product, a
peer that holds a link) leaves it behind when the test's own process dies outright (SIGKILL,
no teardown): a killed suite run once left two hogs spinning at 100 % CPU. Such a helper's
main loop checks at every turn that the process which started it is still its parent; once
that parent is gone, the kernel has handed the orphan to another process (init, or a
subreaper) and the loop ends.
"""

from __future__ import annotations

import os


def while_parent_lives(body: str) -> str:
    """Python source, for ``python -c``, that runs ``body`` (one line) again and again while
    the process calling this lives, then exits at once.

    Call it in the process that starts the helper: its pid is the parent checked. A turn of
    ``body`` should be short (a sleep of a fraction of a second, a bounded loop), since the
    check runs between two turns. ``os._exit`` ends the helper even when threads it started
    would keep an interpreter alive."""
    return f"import os\nwhile os.getppid() == {os.getpid()}:\n    {body}\nos._exit(0)\n"
