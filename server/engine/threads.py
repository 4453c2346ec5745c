"""One team of compute threads in the process: the engine thread's.

torch's CPU kernels run their parallel regions on OpenMP (GNU libgomp in the PyPI wheels), and every
thread that enters one keeps a team of its own. Once the teams' threads outnumber the CPUs, libgomp
stops letting idle workers spin between parallel regions: each region then waits for its workers to
be woken. A decode step is a thousand short regions (a linear layer of one row takes tens of
microseconds), so that wake-up doubled its time: measured on a 2-core EPYC, the default model's linear
layers of one decode step took 10 ms from the only team, 22 ms from the engine thread once the loading
thread had a team too (bench/probes/step_cost.py measures in-process, from the main thread, and never showed it).

So the server starts every thread single-threaded for torch (OMP_NUM_THREADS=1, set before torch is
imported) and gives the compute threads back to the threads whose work is compute: the engine thread,
and the loading thread while it loads (it ends once the models are up, its team with it). Tokenizing,
sessions, offloading and HTTP threads then never hold a team.
"""

from __future__ import annotations

import os

COMPUTE_THREADS_ENV = "KVSERVE_COMPUTE_THREADS"


def confine_to_one_team() -> None:
    """At process start, before torch is imported: other threads default to one OpenMP thread; the count the
    operator asked for (OMP_NUM_THREADS) or the CPUs this process may use go to the compute threads."""
    if COMPUTE_THREADS_ENV not in os.environ:
        asked = os.environ.get("OMP_NUM_THREADS", "")
        os.environ[COMPUTE_THREADS_ENV] = asked if asked.isdigit() and int(asked) > 0 else str(_usable_cpus())
    os.environ["OMP_NUM_THREADS"] = "1"


def compute_threads() -> int:
    """Threads for the engine's parallel regions: KVSERVE_COMPUTE_THREADS, else the CPUs this process may use."""
    value = os.environ.get(COMPUTE_THREADS_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else _usable_cpus()


def use_compute_threads() -> None:
    """Called by a compute thread (the engine's, the loader's) before its first parallel region."""
    import torch

    torch.set_num_threads(compute_threads())


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
