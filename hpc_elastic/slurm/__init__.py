"""The Slurm layer: what hpc-elastic asks of Slurm and reads from it, as values.

- ``commands``: Slurm's tools as functions (``sbatch``, ``squeue``, ``sinfo``, ``scancel``,
  ``scontrol``), through one subprocess call, their text and failures turned into values and
  one-sentence ``SlurmError``s;
- ``env``: what Slurm tells a process (its ``SLURM_*`` variables), read once;
- ``elastic``: ``ElasticSlot``, a slot's life as an array task (its ledger, its requeues and
  ``ExcNodeList``), the one object its agent holds; its parts, one job each: ``arrays`` (the
  job's arrays and the last squeue answer), ``holds`` (held sibling tasks), ``departure`` (why
  a stop came), ``watches`` (drains and the grace time), ``ending`` (the end of the job); and
  under them ``ledger`` (the slot's record) and ``task`` (scontrol on the slot's own task);
- ``queue``: pure readings of squeue's listing of a job (which tasks run, start, pend or are
  held) and the cached slot count, shared by the agent and the operator's commands;
- ``drain``: drained and failing nodes, asked by one agent per job and left at the next
  checkpoint;
- ``grace``: saves timed from the heartbeats against the ``--signal`` lead and GraceTime.

Every Slurm command goes through ``commands``, but for the ``srun`` steps the ZooKeeper
ensemble's supervisor starts and watches (``ensemble/supervisor.py``). submitit is imported
only by ``hpc_elastic/submitit_plugin.py``.
"""
