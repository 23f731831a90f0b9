"""Communicators: typed collectives over NCCL (``NcclCommunicator``), over threads of one process
for CPU tests (``HostCommGroup`` / ``HostCommunicator``), and for one rank
(``SingleRankCommunicator``). All satisfy the ``Communicator`` protocol. Importing this package
does not load NCCL; the first NCCL communicator does."""

from .base import CommDtype, Communicator, ReduceOp
from .host import HostCommGroup, HostCommunicator
from .nccl import NcclCommunicator
from .nccl_lib import NcclLib, load_nccl
from .reduce import reduce_arrays
from .single import SingleRankCommunicator

__all__ = [
    "CommDtype",
    "Communicator",
    "ReduceOp",
    "HostCommGroup",
    "HostCommunicator",
    "NcclCommunicator",
    "NcclLib",
    "load_nccl",
    "reduce_arrays",
    "SingleRankCommunicator",
]
