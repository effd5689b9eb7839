"""The node agent: one per node, it rendezvouses, runs the workers and restarts them.

Read ``api.py`` for the spec and exit codes, ``workers.py`` for process handling,
``agent.py`` for the life cycle, ``command.py`` for the ``hpc-elastic agent`` command.
Nothing in this package imports torch: the agent must start fast and stay small.
"""
