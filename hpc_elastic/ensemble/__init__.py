"""The user's own ZooKeeper ensemble (``hpc-elastic zk``): found, started as a Slurm job or in
the foreground, watched and stopped. Standard library only; nothing here imports kazoo, torch
or jinja2, so the CLI that loads it stays fast (docs/cluster-setup.md).

- ``files``: where the ensemble lives on disk, and the connect-string file other commands read;
- ``choice``: which ZooKeeper a command uses when no ``--zk`` names one;
- ``install``: finding the user's ZooKeeper and Java;
- ``zoocfg``: port choice, the servers' published records and ``zoo.cfg``, all pure;
- ``fourletter``: ``srvr`` and ``mntr``, asked and parsed;
- ``server``: one server's life, as a Slurm step or in the foreground;
- ``lifecycle``: ``zk start``, ``zk status`` and ``zk stop``, through the Slurm layer.
"""
