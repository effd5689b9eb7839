"""The progress heartbeat and the collective marker, from their home in
``hpc_elastic.protocol.heartbeat`` (torch-free, shared with the agent); training scripts that
import them from here keep working.
"""

from hpc_elastic.protocol.heartbeat import (
    CHECKPOINT,
    COLLECTIVE_SUFFIX,
    FINISHED,
    HEARTBEAT_FILE_ENV,
    MARKER_BYTES,
    MIN_INTERVAL,
    Collective,
    CollectiveMarker,
    Heartbeat,
    checkpointing,
    collective_path,
    finish,
    finished,
    mark_checkpoint,
    read,
    read_collective,
    read_marked,
    write,
)

__all__ = [
    "CHECKPOINT",
    "COLLECTIVE_SUFFIX",
    "FINISHED",
    "HEARTBEAT_FILE_ENV",
    "MARKER_BYTES",
    "MIN_INTERVAL",
    "Collective",
    "CollectiveMarker",
    "Heartbeat",
    "checkpointing",
    "collective_path",
    "finish",
    "finished",
    "mark_checkpoint",
    "read",
    "read_collective",
    "read_marked",
    "write",
]
