"""Our C++ kernels (server/kv/csrc): built once per machine with the local compiler, then loaded in a second.

`torch.utils.cpp_extension` compiles them against the installed torch into its extensions
folder (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); `kvserve prepare` (run by
`make install`) builds them ahead. The build is tuned for this CPU (-march=native), so the
build's name carries a digest of the source, the torch version and the CPU's flags: another
CPU builds its own. Where there is no compiler or the build fails, the engine logs why and
runs the portable attention path instead (same answers, one SDPA call per sequence).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger("kvserve.kernels")
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -ffast-math lets exp() vectorize (glibc's libmvec); the kernel never relies on inf or NaN
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
_lock = threading.Lock()
_state: dict[str, bool | str] = {}


def build_name() -> str:
    """The build's name: a new source, torch or CPU builds anew (a -march=native build is not portable)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
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


def unavailable_reason() -> str | None:
    reason = _state.get("reason")
    return str(reason) if reason else None


def _load() -> bool:
    if hasattr(torch.ops.kvserve, "paged_decode"):
        return True  # registered already (another loader in this process)
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=build_name(), sources=[str(SOURCE)], extra_cflags=CFLAGS, is_python_module=False, verbose=False
        )
    except Exception as exc:  # no compiler, no headers, a failed build: the portable path still answers
        _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("paged decode kernel unavailable (%s); attention runs one SDPA call per sequence", _state["reason"])
        return False
    return True


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
