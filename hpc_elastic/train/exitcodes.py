"""Exit codes a worker uses to tell the agent why it stopped; torch-free, for the agent.

They live in ``hpc_elastic.contract`` with the rest of what agent and workers agree on; this
module keeps the names where the training helpers and older scripts import them.
"""

from hpc_elastic.contract import FENCED_EXIT_CODE, PREEMPTED_EXIT_CODE

__all__ = ["FENCED_EXIT_CODE", "PREEMPTED_EXIT_CODE"]
