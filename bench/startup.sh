#!/usr/bin/env bash
# Start-up time of the CLI: `--help`, `--version` and a dry-run render, against a bare interpreter.
# Usage: bench/startup.sh [PYTHON]   (default: .venv/bin/python). Needs hyperfine.
# Results go to docs/benchmarks.md, section "Start-up".
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-$repo/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo 'print("training")' > "$work/train.py"
cd "$work"
export PYTHONPATH=$repo

hyperfine --warmup 3 --runs 30 --export-markdown "$work/startup.md" \
  --command-name 'python -c pass' "$python -c pass" \
  --command-name 'hpc-elastic --version' "$python -m hpc_elastic --version" \
  --command-name 'hpc-elastic --help' "$python -m hpc_elastic --help" \
  --command-name 'hpc-elastic render --nodes 1:4' "$python -m hpc_elastic render --nodes 1:4 train.py"
cat "$work/startup.md"
