"""Tensor and pipeline parallelism's groups of processes, over MPI (docs/distributed.md).

``group(t, p)`` gives the ranks a model of ``tensor_parallel_size=t`` and
``pipeline_parallel_size=p`` runs on, ``n = t * p`` of them:

- in a process ``mpirun -np n`` started, the job's ranks: rank 0 gets the group; every other rank
  serves rank 0's models inside this call and then ends its process (``mpirun -np 2 python
  script.py`` runs the script's ``LLM(..., tensor_parallel_size=2)`` on both ranks);
- otherwise this process as rank 0 and ``n - 1`` ``python -m ferrum.worker`` processes that it
  starts on this machine (an OpenMPI singleton spawning them).

Rank 0 runs the scheduler and Python; the other ranks follow its orders. A collective that waits
longer than ``FERRUM_TP_TIMEOUT`` seconds (default 60) for a rank that exited or hangs raises
RuntimeError on rank 0, and the group's other ranks are ended.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import List, Optional

from . import _core

TIMEOUT_ENV = "FERRUM_TP_TIMEOUT"
PARTITION_ENV = "FERRUM_PP_LAYER_PARTITION"
DEFAULT_TIMEOUT_S = 60.0

_world = None  # the mpirun job's group, once made
_spawned: List = []  # groups this process started, ended at exit at the latest
_exit_hook = False


def launched_ranks() -> int:
    """The rank count of the mpirun job that started this process (0: not started by mpirun)."""
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", "0"))


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return value


def check_sizes(tensor_parallel_size, pipeline_parallel_size) -> None:
    for name, v in (("tensor_parallel_size", tensor_parallel_size), ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def layer_partition(partition, pipeline_parallel_size: int) -> List[int]:
    """Layers per pipeline stage as given (``"3,5"`` or a sequence of ints), else from
    ``FERRUM_PP_LAYER_PARTITION`` for a model of several stages; [] for the cheapest split. The
    counts are checked against the model when it loads (ValueError)."""
    source = "pipeline_layer_partition"
    if partition is None and pipeline_parallel_size > 1:
        partition, source = os.environ.get(PARTITION_ENV) or None, PARTITION_ENV
    if partition is None:
        return []
    items = partition.split(",") if isinstance(partition, str) else partition
    try:
        counts = [int(x.strip()) if isinstance(x, str) else x for x in items]
    except (TypeError, ValueError):
        counts = None
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) for c in counts):
        raise ValueError(f"{source} must be layer counts per stage, like \"3,5\", got {partition!r}")
    return counts


def group(tensor_parallel_size: int, pipeline_parallel_size: int = 1):
    """The group for a model split between ``tensor_parallel_size * pipeline_parallel_size``
    ranks; None for one rank."""
    check_sizes(tensor_parallel_size, pipeline_parallel_size)
    n = tensor_parallel_size * pipeline_parallel_size
    launched = launched_ranks()
    if launched > 1 and launched != n:
        what = (f"tensor_parallel_size x pipeline_parallel_size is {tensor_parallel_size} x {pipeline_parallel_size}"
                if pipeline_parallel_size > 1 else f"tensor_parallel_size is {n}")
        raise ValueError(f"mpirun started {launched} ranks, but {what}: they must be equal")
    if n == 1:
        return None
    _at_exit_end_groups()  # (without MPI in this build, the group's making raises ValueError)
    # OpenMPI's topology library would open every OpenCL platform to list its devices (pocl
    # loads LLVM: ~60 MB per rank); the ranks need only the CPUs.
    os.environ.setdefault("HWLOC_COMPONENTS", "-opencl")
    if launched > 1:
        world = _world_group()
        if world.rank != 0:
            _follow_and_exit(world)
        if not world.is_open:
            raise RuntimeError("this mpirun job's tensor-parallel group has ended")
        return world
    g = _core.mpi_spawn(n, sys.executable, ["-m", "ferrum.worker"], timeout_s())
    _spawned[:] = [s for s in _spawned if s.is_open] + [g]
    return g


def release(g) -> None:
    """Ends a group this process started, once its model is done with (a no-op for None, for
    mpirun's group, which lasts until the process exits, and for a group already ended)."""
    if g is not None and g is not _world and g.is_open:
        try:
            _core.end_group(g)
        except RuntimeError:  # a rank is gone: the group has ended them already
            pass


def follow(g) -> int:
    """A rank other than 0: serves rank 0's models until it ends the group; returns the process's
    exit status (1 when rank 0 is gone, with the reason on stderr)."""
    try:
        _core.follow_orders(g)
    except Exception as e:  # noqa: BLE001 (rank 0 is gone, or its orders made no sense: say why, exit)
        print(f"ferrum: tensor-parallel rank {g.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    _core.mpi_finalize()
    return 0


def _world_group():
    global _world
    if _world is None:
        _world = _core.mpi_world(timeout_s())
    return _world


def _follow_and_exit(world) -> None:
    status = follow(world)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the script's code after LLM() is rank 0's alone


def _end_groups() -> None:
    for g in _spawned:
        release(g)
    if _world is not None and _world.rank == 0 and _world.is_open:
        try:
            _core.end_group(_world)
        except RuntimeError:
            pass
    _core.mpi_finalize()


def _at_exit_end_groups() -> None:
    global _exit_hook
    if not _exit_hook:
        atexit.register(_end_groups)
        _exit_hook = True
