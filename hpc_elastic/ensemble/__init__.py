"""The user's own ZooKeeper ensemble (``hpc-elastic zk``): found, started as a Slurm job or in
the foreground, watched, a lost server replaced, and stopped. Standard library only, but for
``admin``, which the ensemble's supervisor alone loads: nothing the CLI loads imports kazoo,
torch or jinja2, so it stays fast (docs/cluster-setup.md).

- ``files``: where the ensemble lives on disk, and the connect-string file other commands read;
- ``choice``: which ZooKeeper a command uses when no ``--zk`` names one;
- ``install``: finding the user's ZooKeeper and Java;
- ``zoocfg``: port choice, the servers' published records and ``zoo.cfg``, all pure;
- ``fourletter``: ``srvr`` and ``mntr``, asked and parsed;
- ``server``: one server's life, as a Slurm step or in the foreground;
- ``supervisor``: the ensemble job's script: runs, restarts and replaces its servers;
- ``admin``: ZooKeeper's superuser, the one client that reconfigures the ensemble;
- ``lifecycle``: ``zk start``, ``zk status`` and ``zk stop``, through the Slurm layer.
"""
