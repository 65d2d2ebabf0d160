"""engine/threads.py: ``run_in_thread`` returns fn's result or re-raises its exception, and the OpenMP team that a
parallel torch op made on that thread ends with it (the process's OS threads come back to what they were), so a
server that loads its model there leaves the engine thread's team the only one."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.threads import run_in_thread


def os_threads() -> int:
    """How many OS threads this process has now (Linux; 0 where /proc is not there)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return 0


def test_result_and_exception() -> None:
    assert run_in_thread(lambda: threading.current_thread().name, name="x-load") == "x-load"
    with pytest.raises(ValueError, match="boom"):
        run_in_thread(lambda: (_ for _ in ()).throw(ValueError("boom")))


@pytest.mark.skipif(torch.get_num_threads() < 2 or os_threads() == 0, reason="needs 2 torch threads and /proc")
def test_the_threads_openmp_team_ends_with_it() -> None:
    before = os_threads()

    def parallel() -> float:
        a = torch.randn(256, 256)
        assert torch.get_num_threads() >= 2
        return float(torch.mm(a, a).sum())  # a parallel region: this thread's own OpenMP team

    def during() -> int:
        parallel()
        return os_threads()

    assert run_in_thread(during) > before  # the thread and its team's workers
    deadline = time.monotonic() + 30  # detached workers exit after the team is freed: wait for it, not a time
    while os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os_threads() == before


def test_serve_bounds_the_openmp_spin_unless_the_user_set_it() -> None:
    from prefixcache.cli.serve import OPENMP_SPIN, bound_openmp_spin

    env: dict[str, str] = {}
    assert bound_openmp_spin(env) and env == {"GOMP_SPINCOUNT": OPENMP_SPIN}
    for given in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "passive"}):
        env = dict(given)
        assert not bound_openmp_spin(env) and env == given
