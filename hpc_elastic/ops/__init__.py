"""Operating a job: status, list, logs, events and the timeline plot, across requeues.

Everything here reads what a job leaves behind (``job.json``, ``events.jsonl``, the per-rank
logs) and, while it runs, asks the rendezvous and Slurm; nothing here changes a job.
"""
