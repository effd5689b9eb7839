"""The package's version, in a module of its own: every layer may name it (the scripts and job
records carry it) without importing ``hpc_elastic/__init__``, which sits on top of the Python
API. Hatch reads it from here (``[tool.hatch.version]`` in pyproject.toml)."""

__version__ = "0.1.0"
