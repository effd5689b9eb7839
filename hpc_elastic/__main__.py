"""``python -m hpc_elastic`` runs the CLI, so sbatch scripts need no console script on PATH."""

from hpc_elastic.cli import main

main()
