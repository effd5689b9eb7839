"""The worker protocol: what the agent and its workers tell each other through files, torch-free,
so that the agent never imports the training package and a worker never imports the agent.

- ``heartbeat``: the progress file each rank writes (its step, a checkpoint mark, finished) and
  the collective marker beside it; the agent reads both to time the ranks and to find who hung.
- ``assignment``: the in-place hand-over of a new round to a surviving worker, and the worker's
  acknowledgement.
- ``lease``: the file the agent renews while its round is live, and the workers' self-fencing
  once it goes stale.

The exit codes (75 preempted, 77 fenced) and the variables that name these files are in
``hpc_elastic.contract``, with the rest of what both sides agree on. ``hpc_elastic.train``
re-exports these modules under their old names (``hpc_elastic.train.heartbeat``, ...), so
training scripts that import them from there keep working.
"""
