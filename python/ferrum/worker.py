"""A tensor-parallel rank that ``ferrum.dist`` starts (``python -m ferrum.worker``): it joins the
process that spawned it and serves that process's models until it ends the group."""
import sys

from . import _core, dist


def main() -> int:
    return dist.follow(_core.mpi_parent(dist.timeout_s()))


if __name__ == "__main__":
    sys.exit(main())
