"""Our C++ kernels (server/kv/csrc): built once per machine with the local compiler, then loaded in a second.

`torch.utils.cpp_extension` compiles them against the installed torch into its extensions
folder (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); `kvserve prepare` (run by
`make install`) builds them ahead. The build is tuned for this CPU (-march=native), so the
build's name carries a digest of the source, the torch version and the CPU's flags: another
CPU builds its own. It also digests where the source lies: torch's build files name the source
by its absolute path, so two checkouts on one machine sharing a build would rebuild it in turn,
and every start of either would wait for a compile. Where there is no compiler or the build
fails, the engine logs why and runs the portable attention path instead (one SDPA call per
sequence; equal up to rounding).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("kvserve.kernels")
_CSRC = Path(__file__).parent / "csrc"
SOURCES = [_CSRC / name for name in ("paged_decode.cpp", "paged_prefill.cpp", "bf16_gemv.cpp", "decode_step.cpp")]
HEADERS = [_CSRC / "kernels.h"]  # included by the sources: digested with them
# -ffast-math lets exp() vectorize (glibc's libmvec); the kernel never relies on inf or NaN. -fopenmp: at::parallel_for
# is a header template that runs its range on torch's OpenMP team only where the including code is built with
# OpenMP; without it every kernel ran on one thread. It links libgomp.so.1, the one torch has loaded already.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # tuples: torch's loader appends to the lists it is given
_lock = threading.Lock()
_state: dict[str, bool | str] = {}


def build_name() -> str:
    """The build's name: a new source, torch or CPU builds anew (a -march=native build is not portable), and
    so does another checkout (its own build files)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
        digest.update(str(source.resolve()).encode())
    digest.update(" ".join((*CFLAGS, *LDFLAGS)).encode())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    return f"kvserve_kernels_{digest.hexdigest()[:12]}"


def paged_decode_available() -> bool:
    """Whether torch.ops.kvserve.paged_decode can run here (builds it on first call; False if it cannot)."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return bool(_state["loaded"])


def paged_prefill_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch.ops.kvserve.paged_prefill serves this pool: bf16, a head size of 64 or 128, a CPU with
    AVX512-BF16 (the build is -march=native: it has the kernel only where the CPU has the instructions)."""
    if dtype != torch.bfloat16 or not paged_decode_available():
        return False
    return bool(torch.ops.kvserve.paged_prefill_available(head_dim))


def unavailable_reason() -> str | None:
    reason = _state.get("reason")
    return str(reason) if reason else None


def _load() -> bool:
    if hasattr(torch.ops.kvserve, "paged_decode"):
        return True  # registered already (another loader in this process)
    from torch.utils import cpp_extension

    name = build_name()
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no headers, a failed build: the portable path still answers
        _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("paged decode kernel unavailable (%s); attention runs one SDPA call per sequence", _state["reason"])
        return False
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder per machine at a time, by a lock the kernel drops if its holder dies.

    torch's own build lock is a file that a killed build leaves behind, and every later start would
    wait on it forever. Under this lock no build is running, so such a file is stale: it goes.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvserve.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # torch's FileBaton, left by a killed build
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


def _cpu_flags() -> str:
    return cpuinfo_field("flags") or platform.processor()


def cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo (None off Linux or when absent)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
