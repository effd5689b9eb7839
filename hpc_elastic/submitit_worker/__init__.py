"""The script every rank of a submitit job runs (``worker.py``).

It sits in a folder of its own because ``python -u DIR/worker.py`` puts DIR first on
``sys.path``: in ``hpc_elastic/`` itself, our ``events.py`` or ``config.py`` would shadow any
installed module of the same name in the user's function.
"""
