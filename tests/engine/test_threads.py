"""One OpenMP team in the process, the engine thread's: other threads start with one thread for torch."""

from __future__ import annotations

import pytest
import torch

from server.engine import threads
from tests.helpers import ask, make_engine


def test_the_operators_thread_count_goes_to_the_compute_threads_and_every_other_thread_gets_one(monkeypatch):
    monkeypatch.delenv(threads.COMPUTE_THREADS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    threads.confine_to_one_team()
    assert threads.compute_threads() == 3
    assert threads.os.environ["OMP_NUM_THREADS"] == "1"


def test_without_a_count_the_compute_threads_are_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv(threads.COMPUTE_THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_usable_cpus", lambda: 5)
    threads.confine_to_one_team()
    assert threads.compute_threads() == 5
    assert threads.os.environ["OMP_NUM_THREADS"] == "1"
    threads.confine_to_one_team()  # a second call keeps the count it found first
    assert threads.compute_threads() == 5


def test_the_engine_thread_computes_with_the_compute_threads(tiny, monkeypatch):
    monkeypatch.setenv(threads.COMPUTE_THREADS_ENV, "1" if torch.get_num_threads() > 1 else "2")
    want = threads.compute_threads()
    engine = make_engine(tiny)
    try:
        assert ask(engine, torch.get_num_threads) == want
    finally:
        engine.stop()


@pytest.mark.parametrize("given", ["0", "-2", "two", ""])
def test_a_count_that_is_no_positive_number_is_refused_for_the_cpus_this_process_may_use(monkeypatch, given):
    """KVSERVE_COMPUTE_THREADS=0 (or OMP_NUM_THREADS=0 at start) is no thread count: torch would be told 0."""
    monkeypatch.setattr(threads, "_usable_cpus", lambda: 5)
    monkeypatch.setenv(threads.COMPUTE_THREADS_ENV, given)
    assert threads.compute_threads() == 5
    monkeypatch.delenv(threads.COMPUTE_THREADS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", given)
    threads.confine_to_one_team()
    assert threads.os.environ[threads.COMPUTE_THREADS_ENV] == "5"
    assert threads.compute_threads() == 5
    assert threads.os.environ["OMP_NUM_THREADS"] == "1"
