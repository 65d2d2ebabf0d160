"""One OpenMP team per process: torch's parallel ops run on the engine thread only.

Each thread that runs a parallel torch op on the CPU becomes the master of an OpenMP team of its own, with worker
threads that stay for the thread's life. GNU OpenMP (torch's CPU builds) counts every team's workers, and once the
process holds more of them (plus the first thread) than the machine has CPUs, every worker stops spinning between
parallel regions after ~100 iterations and sleeps in the kernel (``do_spin`` in libgomp's ``wait.h``: the
"throttled" spin count): between the many small regions of a step the workers sleep and must be woken, and the
cores idle. A server that loads the model on its main thread and steps it on an engine thread holds two teams
(1 + 1 + 1 workers on 2 CPUs), so it is throttled; ``bench_engine_steps`` (one thread) is not.

``run_in_thread`` runs the loading (and anything else that runs torch before serving) on a short-lived thread:
when it ends, libgomp frees its team (``gomp_free_thread``), so the engine thread's team is the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_thread(fn: Callable[[], T], name: str = "prefixcache-load") -> T:
    """``fn()`` on a new thread that ends with it (its OpenMP team goes with it); its result, or its exception
    re-raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result
