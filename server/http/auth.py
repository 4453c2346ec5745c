"""API keys and tenants: which tenant a request belongs to, decided before anything else reads it.

Keys come from `KVSERVE_API_KEYS` ("key:tenant,key2:tenant2") and/or `KVSERVE_API_KEYS_FILE`
(one "key:tenant" per line, `#` comments). A key without a tenant gets a tenant of its own.
Keys are kept as SHA-256 digests and compared in constant time against every configured key,
so neither the comparison nor the number of matching characters leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvserve")
DEFAULT_TENANT = "default"


@dataclass(slots=True, frozen=True)
class KeyRing:
    digests: tuple[tuple[bytes, str], ...] = ()  # (sha256(key), tenant)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def tenant_for(self, presented: str) -> str | None:
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for known, tenant in self.digests:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    @property
    def tenants(self) -> set[str]:
        return {tenant for _digest, tenant in self.digests}


KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{8,512}")
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")


def parse_keys(text: str) -> list[tuple[str, str]]:
    """`key:tenant` items separated by commas or lines; `#` starts a comment. Keys of 8+ URL-safe characters."""
    pairs = []
    for raw in text.replace(",", "\n").splitlines():
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        key, _, tenant = item.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError("API keys are 8-512 characters of [A-Za-z0-9._~+/=-]")
        pairs.append((key, tenant))
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("the same API key is listed twice")
    for _, tenant in pairs:
        if tenant and not TENANT_PATTERN.fullmatch(tenant):
            raise ValueError(f"tenant names are 1-64 characters of [A-Za-z0-9._-] (got {tenant[:64]!r})")
    # A key without a tenant gets a name of its own that stays its own when keys are added, removed or
    # reordered (a position would hand one key's sessions to another after a restart): a digest of the key,
    # which says nothing of the key itself. A generated name another key also names would merge two tenants.
    named = {tenant for _, tenant in pairs if tenant}
    generated = [(key, tenant or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]) for key, tenant in pairs]
    for (_, given), (_, made) in zip(pairs, generated, strict=True):
        if not given and made in named:
            raise ValueError(f"an unnamed key would get the tenant name {made!r}, which another key names; name it")
    return generated


class KeysRefused(ValueError):
    """Keys configured but not usable: `settings` names the Settings fields at fault (api_keys, api_keys_file),
    the message what is wrong; `kvserve serve` says both in one line and exits 2, as for any bad setting."""

    def __init__(self, settings: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.settings = settings


def load_keys(inline: str | None, path: Path | None) -> KeyRing:
    """Raises KeysRefused when keys were configured but one is malformed, the file cannot be read, or none is
    found: a server must not fall open."""
    text = ""
    if path is not None:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise KeysRefused(("api_keys_file",), f"{str(path)!r} cannot be read: {why}") from None
    for setting, given in (("api_keys", inline or ""), ("api_keys_file", text)):
        try:
            parse_keys(given)
        except ValueError as exc:
            raise KeysRefused((setting,), str(exc)) from None
    configured = tuple(name for name, given in (("api_keys", inline), ("api_keys_file", path)) if given)
    try:
        pairs = parse_keys((inline or "") + "\n" + text)  # what only both together break: a key in each
    except ValueError as exc:
        raise KeysRefused(configured, str(exc)) from None
    if configured and not pairs:
        where = f" in {str(path)!r}" if path is not None else ""
        raise KeysRefused(configured, f"API keys are configured but none was found{where}")
    return KeyRing(tuple((hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in pairs))


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def announce(keys: KeyRing, host: str) -> None:
    """Say at start what protects this server; loudly when nothing does on a non-loopback address."""
    if keys:
        log.info(
            "API keys: %d keys for %d tenants; every route but /health and /ready needs one",
            len(keys.digests),
            len(keys.tenants),
        )
    elif is_loopback(host):
        log.info(
            "no API keys configured: listening on %s only (loopback); set KVSERVE_API_KEYS to serve a network", host
        )
    else:
        log.warning("!" * 78)
        log.warning("NO API KEYS and listening on %s: anyone who can reach this port can use it,", host)
        log.warning("and all callers share one tenant (they can see each other's sessions).")
        log.warning("Set KVSERVE_API_KEYS or KVSERVE_API_KEYS_FILE.")
        log.warning("!" * 78)
