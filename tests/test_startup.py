"""Start-up's safe points (server/startup.py): a stop asked is raised at the next one, in the phase it is in."""

from __future__ import annotations

import fcntl
import logging
import threading

import pytest

from server.models.convert import converted, gguf_cache_dir, lock_path
from server.startup import HOLD_ENV, Startup, StartupStopped
from tests.helpers import DEADLINE_S, wait_until
from tests.tiny_gguf import save_tiny_gguf


def test_a_stop_is_raised_at_the_next_safe_point_naming_the_phase():
    startup = Startup()
    startup.enter("load")
    startup.check()
    startup.stop()
    with pytest.raises(StartupStopped) as stopped:
        startup.check()
    assert stopped.value.args == ("load",)
    with pytest.raises(StartupStopped):
        startup.enter("kernels")
    assert startup.phase == "load"  # never entered
    assert not issubclass(StartupStopped, Exception)  # no phase's fallback (`except Exception`) takes it


@pytest.mark.parametrize("value", ["lunch", "load:later", "app:stuck"])
def test_the_hook_names_a_phase(value):
    with pytest.raises(ValueError, match=f"{HOLD_ENV}: '{value}' is not one of app, convert, load"):
        Startup(value)


def test_a_wait_for_another_process_s_conversion_ends_when_start_up_is_asked_to_stop(tmp_path, caplog):
    """Another replica converts (it holds the lock) for minutes: a stop must not wait for it."""
    gguf = save_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    cache.mkdir()
    target = gguf_cache_dir(gguf, cache, "tiny")
    startup, raised = Startup(), []
    caplog.set_level(logging.INFO, "kvserve.convert")

    def convert() -> None:
        try:
            converted(gguf, cache, "tiny", startup)
        except StartupStopped as exc:
            raised.append(exc)

    with open(lock_path(target), "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        waiter = threading.Thread(target=convert, daemon=True)
        waiter.start()
        wait_until(lambda: "waiting for another process converting" in caplog.text, what="the wait for the lock")
        startup.stop()
        waiter.join(DEADLINE_S)
        stuck = waiter.is_alive()
    assert not stuck, "the wait for the lock did not end on the stop"
    assert len(raised) == 1
    assert not target.exists()
    assert not list(cache.glob("*.partial"))
