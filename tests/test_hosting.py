"""The model host's shutdown while a model loads (server/hosting.py)."""

from __future__ import annotations

import threading

from server import hosting
from server.hosting import ModelHost
from server.settings import Settings
from tests.helpers import DEADLINE_S, wait_until


def test_close_waits_for_the_loading_thread_to_stop_before_it_saves(tiny_spec, monkeypatch):
    """The loading thread asked to stop reaches its next safe point (here: when the test lets it) before the
    shutdown writes the sessions' records: it is never still inside torch when the process exits normally."""
    release = threading.Event()

    def load(spec, cache_dir, startup):
        startup.enter("load")
        release.wait(DEADLINE_S)  # a load in progress: no safe point until the test lets it go
        startup.check()

    monkeypatch.setattr(hosting, "load_model", load)
    host = ModelHost(Settings(state_dir=None, shutdown_grace_s=3600), [tiny_spec])
    running_at_save: list[list[str]] = []
    save_all = host.store.save_all

    def spy():
        running_at_save.append(host.running_threads)
        return save_all()

    monkeypatch.setattr(host.store, "save_all", spy)
    host.start()
    wait_until(lambda: host.startup.phase == "load", what="the load to begin")
    closer = threading.Thread(target=host.close, daemon=True)
    closer.start()
    wait_until(lambda: host.startup.is_stopping, what="close to ask the loading thread to stop")
    release.set()
    closer.join(DEADLINE_S)
    assert not closer.is_alive()
    assert running_at_save == [[]]
    assert host.states[tiny_spec.id].status == "stopped"
    assert host.states[tiny_spec.id].detail == "not loaded: start-up stopped (phase load)"
