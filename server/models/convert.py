"""GGUF -> safetensors, once: dequantizing takes tens of seconds, reloading the result about one.

Replicas started at once on one cache directory (compose --scale, a Deployment over a shared volume)
convert a model once between them: the first takes a lock beside the target and converts into a
directory of its own, renamed into place when whole; the others wait for the lock, log that they do,
and then find the target. A conversion that died leaves its partial directory, removed by the next
holder of the lock (no other conversion of that target can be running then).

Start-up can be stopped while it converts or waits (server/startup.py): between the conversion's steps, and while
it waits for another process's lock, a stop unwinds it, its partial directory removed and its lock released.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch
from tqdm.auto import tqdm

from server.startup import Startup

log = logging.getLogger("kvserve.convert")
FINGERPRINT_BYTES = 4 << 20
LOCK_POLL_S = 0.2  # how often a process waiting for another's conversion looks whether it was asked to stop


def gguf_cache_dir(gguf: Path, cache_dir: Path, model_id: str) -> Path:
    """One directory per GGUF content: size plus a hash of its first bytes (hashing 100 MB+ each start is waste)."""
    digest = hashlib.sha256(str(gguf.stat().st_size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    return cache_dir / f"{safe_id}-{digest.hexdigest()[:16]}"


def converted(gguf: Path, cache_dir: Path, model_id: str, startup: Startup | None = None) -> Path:
    """The directory of `gguf` converted to safetensors under `cache_dir`, converted now unless this or another
    process did it before. `startup`: what may ask it to stop (StartupStopped, raised at a safe point)."""
    startup = startup or Startup()
    target = gguf_cache_dir(gguf, cache_dir, model_id)
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    waiting = f"model {model_id}: waiting for another process converting {gguf.name}"
    with _conversion_lock(target, waiting, startup):
        if target.is_dir():  # the process we waited for converted it
            log.info("model %s: %s was converted by another process meanwhile: %s", model_id, gguf.name, target)
            return target
        for stale in glob.glob(glob.escape(str(target)) + ".*.partial"):  # a conversion that died
            log.info("removing %s, left by a conversion that did not finish", stale)
            shutil.rmtree(stale, ignore_errors=True)
        # A name of its own (a process that takes no lock, an older version, never writes into it), made with the
        # umask's mode: mkdtemp's 0700 would keep replicas running as other users out of the converted model.
        partial = target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
        partial.mkdir()
        log.info("model %s: converting %s to safetensors in %s (once)", model_id, gguf.name, target)
        try:
            startup.enter("convert")
            convert_gguf(gguf, partial, startup)
            os.rename(partial, target)  # atomic: no reader ever sees a half-written directory
        except OSError:
            if not target.is_dir():
                raise
            # Renamed onto a directory a process that takes no lock (an older version) wrote meanwhile: use it.
        finally:  # gone when renamed; what a failed or stopped conversion wrote
            shutil.rmtree(partial, ignore_errors=True)
    return target


def lock_path(target: Path) -> Path:
    """The lock a process holds while it converts into `target` (kept: removing it could part two waiters)."""
    return target.with_name(target.name + ".lock")


@contextlib.contextmanager
def _conversion_lock(target: Path, waiting: str, startup: Startup) -> Iterator[None]:
    """Held while `target` is converted: released by the kernel when its holder's process ends, however it ends.
    `waiting` is logged when another process holds it; the wait ends early when start-up is asked to stop."""
    with open(lock_path(target), "a") as holder:
        if not _try_lock(holder):
            log.info("%s into %s", waiting, target)
            while not _try_lock(holder):  # not a blocking flock: a stop asked meanwhile must end the wait
                startup.check()
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


def _try_lock(holder: IO[str]) -> bool:
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def convert_gguf(gguf: Path, directory: Path, startup: Startup | None = None) -> None:
    """Write `gguf` as a transformers model (safetensors weights, config, tokenizer) into `directory`; `startup`
    is asked between the steps whether to stop."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    startup = startup or Startup()
    steps = tqdm(total=4, desc=f"kvserve: converting {gguf.name}", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    startup.check()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    startup.check()
    # A GGUF-loaded model refuses save_pretrained: rebuild it from a config without the quantization entry.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    steps.update()
    startup.check()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    steps.update()
    steps.close()
