"""The Slurm layer: what hpc-elastic asks of Slurm and reads from it, as values.

- ``commands``: Slurm's tools as functions (``sbatch``, ``squeue``, ``sinfo``, ``scancel``,
  ``scontrol``), through one subprocess call, their text and failures turned into values and
  one-sentence ``SlurmError``s;
- ``env``: what Slurm tells a process (its ``SLURM_*`` variables), read once;
- ``elastic``: a slot's life as an array task: who is coming, who leaves and why, requeues,
  ``ExcNodeList``, held tasks, the job's arrays;
- ``queue``: pure readings of squeue's listing of a job (which tasks run, start, pend or are
  held) and the cached slot count, shared by the agent and the operator's commands;
- ``drain``: drained and failing nodes, asked by one agent per job and left at the next
  checkpoint;
- ``grace``: saves timed from the heartbeats against the ``--signal`` lead and GraceTime.

Every Slurm command goes through ``commands``, but for the ``srun`` steps the ZooKeeper
ensemble's supervisor starts and watches (``ensemble/supervisor.py``). submitit is imported
only by ``hpc_elastic/submitit_plugin.py``.
"""
