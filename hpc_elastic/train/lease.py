"""Worker self-fencing, from its home in ``hpc_elastic.protocol.lease`` (torch-free, shared
with the agent); training scripts that import it from here keep working.
"""

from hpc_elastic.protocol.lease import (
    LEASE_FILE_ENV,
    LEASE_TIMEOUT_ENV,
    MIN_INTERVAL,
    Lease,
    check,
    current,
    exit_fenced,
    expired,
    renew,
)

__all__ = [
    "LEASE_FILE_ENV",
    "LEASE_TIMEOUT_ENV",
    "MIN_INTERVAL",
    "Lease",
    "check",
    "current",
    "exit_fenced",
    "expired",
    "renew",
]
