"""The Slurm layer: the only place that runs Slurm commands or imports submitit.

``env`` reads the job's SLURM_* variables; ``commands`` wraps sbatch, squeue, sinfo, scancel and
scontrol, turning their text and their failures into values and one-sentence ``SlurmError``s.
"""
