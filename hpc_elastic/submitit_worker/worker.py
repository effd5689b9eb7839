"""What every rank of a submitit job runs: ``python -u worker.py submission.pkl``.

The agent starts this file as the job's script, in the job directory's name space; the pickle
path is relative to the job directory (``HPC_ELASTIC_JOB_DIR``). See ``submitit_plugin``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpc_elastic.contract import JOB_DIR_ENV
from hpc_elastic.submitit_plugin import run_submission

if __name__ == "__main__":
    run_submission(Path(os.environ.get(JOB_DIR_ENV, ".")) / sys.argv[1])
