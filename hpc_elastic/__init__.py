"""hpc-elastic: keep multi-node PyTorch training alive on Slurm while nodes come and go."""

__version__ = "0.1.0"
