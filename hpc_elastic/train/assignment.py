"""The in-place round assignment, from its home in ``hpc_elastic.protocol.assignment``
(torch-free, shared with the agent); scripts that import it from here keep working.
"""

from hpc_elastic.protocol.assignment import (
    ASSIGNMENT_FIELDS,
    ASSIGNMENT_FILE_ENV,
    ROUND_KEYS,
    Assignment,
    ack_path,
    decode_assignment,
    is_collective_error,
    read_ack,
    read_assignment,
    write_ack,
    write_assignment,
)

__all__ = [
    "ASSIGNMENT_FIELDS",
    "ASSIGNMENT_FILE_ENV",
    "ROUND_KEYS",
    "Assignment",
    "ack_path",
    "decode_assignment",
    "is_collective_error",
    "read_ack",
    "read_assignment",
    "write_ack",
    "write_assignment",
]
