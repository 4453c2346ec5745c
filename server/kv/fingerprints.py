"""Which K/V fingerprint each replica serves a model id with, kept in the shared store (Redis).

Replicas share K/V blocks in Redis only when the blocks' addresses agree: the fingerprint of the form
the shared tier keeps them in (the model's weights, config, tokenizer and dtype, and the shared tier's
K/V dtype, `KVSERVE_SHARED_KV_DTYPE`) and the block size. So replicas serving one model id with other
weights, config, tokenizer or dtype (a fine-tune deployed under the old id, a rolling upgrade half done,
`dtype = "auto"` on CPUs with and without bf16 instructions), or keeping their shared blocks in another
form, are each correct but never restore each other's K/V: every session that moves between them
recomputes. This is how they find out. Each replica writes what it serves a model with
(`Engine.fingerprint_parts`) and what its blocks in Redis are addressed by (`Engine.shared_parts`) under
`kvserve:fp:<replica>:<model>`, which expires unless refreshed (every `period_s`; deleted at a clean
stop, so a replica that is gone drops out), names itself in the set `kvserve:fps:<model>`, and reads
the others'. Another fingerprint is logged as a warning once per replica and fingerprint, and
GET /v1/models/{id} lists the replicas last seen (`peers`), from memory: no request waits on Redis.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

log = logging.getLogger("kvserve.shared")
ENTRY = "kvserve:fp:"  # + replica + ":" + model id (a replica id holds no ":", so the split is unambiguous)
MEMBERS = "kvserve:fps:"  # + model id: the replicas that announced it
PERIOD_S = 5.0  # how often a replica refreshes its entry and reads the others'
TTL_S = 30.0  # an entry not refreshed for this long is a replica that is gone
MEMBERS_TTL_S = 24 * 3600  # the set of names outlives its members' entries; renewed with them
PARTS = {
    "kv_layout": "layout",
    "weights_digest": "weights",
    "config_digest": "config",
    "tokenizer_digest": "tokenizer",
    "shared_kv_layout": "shared layout",  # how the shared tier keeps the K/V (the pool's form, or 8 bits)
    "block_size": "block size",
}


def differing(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The parts of two replicas' entries that differ, by short name (layout, weights, config, tokenizer, shared
    layout, block size)."""
    return [short for name, short in PARTS.items() if ours.get(name) != theirs.get(name)]


def shares_blocks(ours: dict[str, str], theirs: dict[str, str]) -> bool:
    """Whether the two replicas address the K/V blocks they keep in Redis alike: the fingerprint of the form kept
    there and the block size (an entry without them, from an older version: its pool's K/V fingerprint)."""

    def address(parts: dict[str, str]) -> tuple[str | None, str | None]:
        return parts.get("shared_kv_fingerprint", parts.get("kv_fingerprint")), parts.get("block_size")

    return address(ours) == address(theirs)


class FingerprintBoard:
    def __init__(
        self,
        client: Any,
        errors: tuple[type[Exception], ...],
        replica_id: str,
        period_s: float = PERIOD_S,
        ttl_s: float = TTL_S,
    ) -> None:
        """`client`: a redis.Redis (the shared block store's: replicas compare where they share blocks)."""
        self.client, self.errors, self.replica_id = client, errors, replica_id
        self.period_s, self.ttl_s = period_s, ttl_s
        self._lock = threading.Lock()
        self._ours: dict[str, dict[str, str]] = {}  # model id -> this replica's fingerprint parts
        self._peers: dict[str, dict[str, dict[str, str]]] = {}  # model id -> other replica -> its parts
        self._warned: set[tuple[str, str, str]] = set()  # (model id, replica, fingerprint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fingerprint-board", daemon=True)

    def announce(self, model_id: str, parts: dict[str, str]) -> None:
        """Say which fingerprint this replica serves `model_id` with, and compare at once with the others'."""
        with self._lock:
            self._ours[model_id] = dict(parts)
        if not self._beat(model_id):
            log.warning("the shared store did not answer: model %s's K/V fingerprint is compared later", model_id)
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def peers(self, model_id: str) -> list[dict[str, Any]]:
        """The other replicas that serve `model_id`, as last seen: each one's id and fingerprint, whether it
        shares K/V blocks with this replica, and what differs."""
        with self._lock:
            ours = self._ours.get(model_id, {})
            seen = dict(self._peers.get(model_id, {}))
        return [
            {
                "replica": replica,
                "kv_fingerprint": parts.get("kv_fingerprint"),
                "shares_kv_blocks": shares_blocks(ours, parts),
                "differs_in": differing(ours, parts),
            }
            for replica, parts in sorted(seen.items())
        ]

    def close(self) -> None:
        """Stop refreshing and take this replica's entries out (the others stop listing it at their next read)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        with self._lock:
            models = list(self._ours)
        try:
            pipe = self.client.pipeline(transaction=False)
            for model_id in models:
                pipe.delete(f"{ENTRY}{self.replica_id}:{model_id}")
                pipe.srem(MEMBERS + model_id, self.replica_id)
            pipe.execute()
        except self.errors:
            log.info("the shared store did not answer: this replica's K/V fingerprints expire there by themselves")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                models = list(self._ours)
            for model_id in models:
                self._beat(model_id)

    def _beat(self, model_id: str) -> bool:
        """Refresh this replica's entry for `model_id`, read the others' and warn about new differences; False
        when Redis did not answer (what was seen last is kept)."""
        with self._lock:
            ours = self._ours[model_id]
        members_key = MEMBERS + model_id
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(f"{ENTRY}{self.replica_id}:{model_id}", json.dumps(ours), px=int(self.ttl_s * 1000))
            pipe.sadd(members_key, self.replica_id)
            pipe.expire(members_key, MEMBERS_TTL_S)
            pipe.smembers(members_key)
            members = pipe.execute()[-1]
            others = sorted(name.decode() for name in members if name.decode() != self.replica_id)
            values = self.client.mget([f"{ENTRY}{other}:{model_id}" for other in others]) if others else []
            gone = [other for other, value in zip(others, values, strict=True) if value is None]
            if gone:  # expired: a replica that died (one alive again adds itself back at its next beat)
                self.client.srem(members_key, *gone)
        except self.errors:
            return False
        peers = {}
        for other, value in zip(others, values, strict=True):
            try:
                parts = json.loads(value) if value is not None else None
            except ValueError:
                parts = None
            if isinstance(parts, dict):
                peers[other] = {str(k): str(v) for k, v in parts.items()}
        with self._lock:
            self._peers[model_id] = peers
        for other, parts in peers.items():
            self._warn_once(model_id, ours, other, parts)
        return True

    def _warn_once(self, model_id: str, ours: dict[str, str], other: str, theirs: dict[str, str]) -> None:
        if shares_blocks(ours, theirs):
            return
        fingerprint = theirs.get("kv_fingerprint", "")
        seen = (model_id, other, f"{fingerprint},{theirs.get('shared_kv_fingerprint')},{theirs.get('block_size')}")
        with self._lock:
            if seen in self._warned:
                return
            self._warned.add(seen)
        parts = differing(ours, theirs)
        names = {short: name for name, short in PARTS.items()}
        details = "; ".join(f"{p} ({ours.get(names[p])} here, {theirs.get(names[p])} there)" for p in parts)
        details = details or "parts this version does not name"
        if fingerprint != ours.get("kv_fingerprint"):
            advice = (
                "pin the dtype in models.toml on every replica"
                if [p for p in parts if p in ("layout", "weights", "config", "tokenizer")] == ["layout"]
                else "serve other weights under a new model id, or finish the rolling upgrade"
            )
            log.warning(
                "model %s: replica %s serves it with another K/V fingerprint (%s; this replica's is %s), they differ "
                "in %s: the two share no K/V blocks, so a session moving between them recomputes its prompt; %s",
                model_id,
                other,
                fingerprint,
                ours.get("kv_fingerprint"),
                details,
                advice,
            )
            return
        log.warning(
            "model %s: replica %s computes the same K/V but keeps its blocks in Redis under other addresses, they "
            "differ in %s: the two share no K/V blocks, so a session moving between them recomputes its prompt; set "
            "KVSERVE_SHARED_KV_DTYPE and KVSERVE_BLOCK_SIZE alike on every replica",
            model_id,
            other,
            details,
        )
