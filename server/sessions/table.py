"""This process's sessions in memory: by key and indexed, under one lock (torch-free).

The session store (store.py) owns one and changes it; its shared-store sync (sync.py) brings entries up to
the records other replicas commit. Every method here expects the caller to hold `lock`.
"""

from __future__ import annotations

import threading

from server.sessions.index import Forgotten, SessionIndex
from server.sessions.record import Session, SessionKey


class SessionTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[SessionKey, Session] = {}
        self.index = SessionIndex()
        self.forgotten = Forgotten()  # sessions gone since the engine last asked: their device K/V may go too

    def insert(self, session: Session) -> None:
        self.sessions[session.key] = session
        self.index.add(session)

    def remove(self, session: Session) -> None:
        del self.sessions[session.key]
        self.index.remove(session)
        if not session.key.is_bucket:
            self.forgotten.add(session)
