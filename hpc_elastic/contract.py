"""What the CLI, the agent, the workers and the training helpers agree on, in one torch-free place.

The environment variables the agent sets for its workers (and the helpers in
``hpc_elastic.train`` read), the exit codes a worker answers with, the files of a job
directory, and the defaults of the agent's knobs. Each side imports the name from here, so a
rename is one edit and neither side can drift; the old homes (``train.exitcodes``,
``events.EVENTS_FILE_ENV``, ...) re-export these names for code that already uses them.
Nothing here imports anything: the agent, which must start fast and never import torch, can
read it, and so can the training helpers.
"""

from __future__ import annotations

from pathlib import Path

# --- environment variables -----------------------------------------------------------------

RUN_ID_ENV = "HPC_ELASTIC_RUN_ID"
"""Set on every local-mode agent (``cancel`` checks it before signalling a process) and on every
worker (``hpc_elastic.tracking``: one tracker run per job across requeues)."""
JOB_DIR_ENV = "HPC_ELASTIC_JOB_DIR"
CHECKPOINT_DIR_ENV = "HPC_ELASTIC_CHECKPOINT_DIR"
EVENTS_FILE_ENV = "HPC_ELASTIC_EVENTS_FILE"
HEARTBEAT_FILE_ENV = "HPC_ELASTIC_HEARTBEAT_FILE"
LEASE_FILE_ENV = "HPC_ELASTIC_LEASE_FILE"
"""Workers' env: a file the agent touches every poll while this node holds a live round and
is connected to the rendezvous. The training helpers stop once its mtime is older than
``LEASE_TIMEOUT_ENV`` seconds: a frozen or cut-off agent cannot stop them, so they fence
themselves before the others re-form without this node (docs/agent.md, "Fencing")."""
LEASE_TIMEOUT_ENV = "HPC_ELASTIC_LEASE_TIMEOUT"
"""Workers' env: seconds after which a lease not renewed is stale: a third of the session
timeout (``rules.fence_after``), since the agent stops renewing only once ZooKeeper reports
SUSPENDED, which may come two thirds of a session after the server last heard from it."""
ASSIGNMENT_FILE_ENV = "HPC_ELASTIC_ASSIGNMENT_FILE"
"""Workers' env, in-place mode only (``agent --in-place``): a file the agent replaces with a
surviving worker's next round (rank, world size, master) instead of killing the worker;
``hpc_elastic.train.InPlace`` reads it at step boundaries (docs/agent.md, "In-place")."""
SECRET_FILE_ENV = "HPC_ELASTIC_SECRET_FILE"
SLOT_ENV = "HPC_ELASTIC_SLOT"
ROUND_ENV = "HPC_ELASTIC_ROUND"
MASTER_PORTS_ENV = "HPC_ELASTIC_MASTER_PORTS"
"""``LOW:HIGH``: rank 0's agent picks the workers' MASTER_PORT in this range (default: a free
port below the kernel's ephemeral range, ``DEFAULT_MASTER_PORTS``)."""
DEFAULT_MASTER_PORTS = (20000, 32767)
"""Where rank 0's agent picks the workers' MASTER_PORT when no range is given: below Linux's
ephemeral range (32768-60999), from which every outgoing connection takes its local port, so
none takes the port in the seconds between the pick and the bind of rank 0's store (the
part of it that the kernel's range leaves out, ``ip_local_port_range``; any free port if
none)."""
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
HOST_ENV = "HPC_ELASTIC_HOST"
NOTIFY_URL_ENV = "HPC_ELASTIC_NOTIFY_URL"
"""``submit --notify``'s web hook, for the agent (never on a command line: see ``notify``).
``submit`` reads it too, as ``--notify`` when no flag gives one."""
USER_SECRET_FILE_ENV = "HPC_ELASTIC_USER_SECRET_FILE"
"""The user's own secret guarding the bad nodes remembered across jobs (``--user-secret-file``);
the user's checkpoint key is derived from it (``hpc_elastic.checkpoint_key``)."""
AGENT_ONLY_ENV = frozenset({NOTIFY_URL_ENV, USER_SECRET_FILE_ENV})
"""Variables the agent reads and never passes on to workers or standbys: secrets that the
training code has no use for (and might log with the rest of its environment). The workers
get the user's checkpoint key, never the user's secret nor where it lies."""
ZK_ENV = "HPC_ELASTIC_ZK"
CHECKPOINT_ASYNC_ENV = "HPC_ELASTIC_CHECKPOINT_ASYNC"
"""``1``: ``save`` copies the state and writes it in the background; ``0`` or unset: inline."""
CHECKPOINT_WHEN_BUSY_ENV = "HPC_ELASTIC_CHECKPOINT_WHEN_BUSY"
"""``wait`` or ``skip``: what an async save does while the previous one is still writing."""
CHECKPOINT_KEEP_ENV = "HPC_ELASTIC_CHECKPOINT_KEEP"
"""How many of the newest committed checkpoints to keep (1 or more)."""
CHECKPOINT_KEEP_EVERY_ENV = "HPC_ELASTIC_CHECKPOINT_KEEP_EVERY"
"""Also keep every checkpoint whose step is a multiple of this (0: none)."""
LOCAL_CHECKPOINT_DIR_ENV = "HPC_ELASTIC_LOCAL_CHECKPOINT_DIR"
"""A node-local directory for the fast tier of checkpoints (unset: no local tier)."""
PERSIST_EVERY_ENV = "HPC_ELASTIC_PERSIST_EVERY"
"""With a local tier: copy every Nth checkpoint to ``HPC_ELASTIC_CHECKPOINT_DIR``."""
DEBUG_ENV = "HPC_ELASTIC_DEBUG"
LOG_ENV = "HPC_ELASTIC_LOG"
"""``debug``, ``info`` or ``warning``: the level of the package's logs on stderr (``logs``)."""
PREFLIGHT_ENV = "HPC_ELASTIC_PREFLIGHT"
"""``0``/``false`` turns off the agent's health checks before it joins (``--no-preflight``)."""
STANDBY_READY_DIR_ENV = "HPC_ELASTIC_STANDBY_READY_DIR"
"""Standby workers' env (``--prewarm``): a directory in which each standby creates a file named
after its pid once its imports are done, so that the agent can tell a warm standby from one
still importing (``StandbyPool.warm``). A standby drops it with the rest of its environment
when it takes its rank."""
SAMPLE_LOG_ENV = "HPC_ELASTIC_SAMPLE_LOG"
"""Workers' env, set by the user: ``1`` makes the training helpers log which samples every
optimizer step trained on, per rank, under the job directory (``SAMPLES_DIR``), for
``hpc-elastic events JOB --data``; a path logs there instead. Unset: nothing is logged."""
INDEX_ENV = "HPC_ELASTIC_INDEX"
"""The per-user index of job directories (``jobdir.index_file``); default
``$XDG_STATE_HOME/hpc-elastic/jobs``, i.e. ``~/.local/state/hpc-elastic/jobs``."""

# --- the files of a job directory (``jobdir.JobDir`` names the full paths) ----------------

JOB_FILE = "job.json"
SECRET_FILE = "secret"
CHECKPOINT_KEY_FILE = "checkpoint-key"
"""The user's checkpoint key (``hpc_elastic.checkpoint_key``), 0600: the workers seal every
checkpoint manifest with it, so the user's next job resumes from them and nobody else's does."""
SCRIPT_FILE = "sbatch.sh"
GROW_SCRIPT_FILE = "sbatch-grow.sh"
"""The growth slots' array script (``--grow-partition``/``--grow-qos``), beside ``SCRIPT_FILE``."""
EVENTS_FILE = "events.jsonl"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
SLOTS_DIR = "slots"
LOCAL_FIRST_FILE = "local-first"
"""In ``SLOTS_DIR``: created by the first agent that finds a whole save no longer fits the time
Slurm leaves, under ``--grace-action local`` (``slurm/grace.py``). While it exists, the save a
stopping loop makes goes to the node-local tier first (``train.local_tier``); the shared tier
gets it at the next start. Kept for the rest of the job: requeued agents know it at once."""
SAMPLES_DIR = "samples"
"""The per-step sample log (``SAMPLE_LOG_ENV``, ``hpc_elastic.samples``): one file per process."""
CODE_DIR = "code"
"""The job's code snapshot: the script's project as it was at submit time (``snapshot``)."""

# --- exit codes ----------------------------------------------------------------------------

PREEMPTED_EXIT_CODE = 75
"""Saved a checkpoint and stopped on request (EX_TEMPFAIL): requeue it, not a failure."""

FENCED_EXIT_CODE = 77
"""Stopped at once, without saving, because the agent's lease went stale (EX_NOPERM): this
worker's round may already have been replaced by one formed without it, so it no longer has the
right to train or to write checkpoints. Not a failure of the worker: its node lost the job."""

UNREACHABLE_EXIT_CODE = 69
"""The agent's exit when every server of the rendezvous stayed out of reach for longer than
``--zk-outage-limit`` (EX_UNAVAILABLE): its slot is not requeued, since the next incarnation
would only join the same dead ensemble, and the job is not failed for the other nodes, which
may still reach it (a partition of this node looks the same from here)."""

# --- defaults ------------------------------------------------------------------------------

DEFAULT_RUNS_DIR = Path("hpc-elastic-runs")
"""Where each run gets its own job directory, relative to the working directory."""
DEFAULT_ZK = "127.0.0.1:2181"
DEFAULT_CONTAINER_PYTHON = "python3"
"""The Python inside a container image (``--container-python``): the name every image with
Python answers to, found on the image's own PATH."""
DEFAULT_NODES = "1"
DEFAULT_NPROC_PER_NODE = 1
DEFAULT_MAX_RESTARTS = 3
DEFAULT_JOB_NAME = "job"
"""A run's name when neither ``--job-name`` nor the script's name gives one."""
DEFAULT_PREWARM = True
"""``--prewarm``: the agents keep standby workers with torch imported, so a restart skips the
import."""
DEFAULT_IN_PLACE = False
"""``--in-place``: off, since only a loop that uses ``hpc_elastic.train.InPlace`` can take the
new round in a surviving worker."""
DEFAULT_PREEMPT_SIGNAL = "USR2@90"
"""What ``submit`` asks Slurm for: USR2, 90 seconds before the time limit or a preemption."""
DEFAULT_GRACE = 30.0
"""Seconds the agent gives its workers to save after a stop signal, when no ``--grace`` came."""
DEFAULT_LAST_CALL = 2.0
DEFAULT_SESSION_TIMEOUT = 6.0
DEFAULT_MIN_WAIT = 600.0
DEFAULT_ZK_OUTAGE_LIMIT = 300.0
"""Seconds an agent cut off from every ZooKeeper server waits for one to come back before it
leaves the job (``UNREACHABLE_EXIT_CODE``): far longer than a server restart or a leader
election, far shorter than the time limit a dead ensemble would otherwise hold the node for."""
DEFAULT_MAX_PREEMPTIONS = 100
DEFAULT_MAX_TIME_LIMITS = 10
DEFAULT_EXCLUDE_AFTER = 2
DEFAULT_BAD_NODE_TTL = 24 * 3600.0
"""How long a node that failed its preflight stays excluded: a day, long enough to outlive a
weekend's requeues, short enough that a repaired node comes back without anyone remembering
to clear it (``--bad-node-ttl``, ``agent/badnodes.py``)."""
DEFAULT_METRICS_BIND = "127.0.0.1"
"""Where the agent serves its metrics unless ``--metrics-bind`` widens it: to this node only.
Job and slot names and the training step are nobody else's business, and a scraper on the
node (node_exporter's neighbour, an SSH tunnel) reaches loopback."""
DEFAULT_USER_SECRET_FILE = Path("~/.hpc-elastic/user-secret")
"""The user's own secret (``USER_SECRET_FILE_ENV``), created 0600 by ``submit`` or ``run``
(which derive the user's checkpoint key from it) or by the first preflight that remembers a
bad node; ``hpc-elastic nodes`` and ``doctor`` read it, never create it. It guards the bad
nodes remembered across the user's jobs in ZooKeeper, which no job's secret may guard since
they outlive it."""
GRACE_ACTIONS = ("warn", "lead", "local")
"""``--grace-action``: what an agent does once a save no longer fits the time Slurm leaves
(``slurm/grace.py``): say so (always, and nothing more with the default ``warn``), and with
``lead`` also move its own time-limit signal earlier (``moved_lead``), with ``local`` also have
every stop's save go to the node-local tier first (``JobDir.local_first``)."""
CHECKPOINT_WHEN_BUSY_CHOICES = ("wait", "skip")
DEFAULT_CHECKPOINT_WHEN_BUSY = "wait"
DEFAULT_CHECKPOINT_KEEP = 3
DEFAULT_CHECKPOINT_KEEP_EVERY = 0
DEFAULT_PERSIST_EVERY = 1
DEFAULT_SNAPSHOT_MAX_MB = 100
"""The largest code snapshot ``submit`` copies without being told: a project past it holds
data or checkpoints, which belong in .gitignore, not in every job directory."""
DEFAULT_SNAPSHOT_MAX_FILES = 10_000
"""The most files a code snapshot copies without being told: a project of code has hundreds;
tens of thousands are a dataset, a ``node_modules`` or a home directory."""

FILES_SPARE = 64
"""Open files a process that holds a connection from every member (the centre of a round's
links) or every rank (the store host) keeps free beyond them, for its other work."""

# --- the user's own ZooKeeper ensemble (``hpc-elastic zk``) --------------------------------

STATE_DIR_ENV = "HPC_ELASTIC_STATE_DIR"
"""The user's state directory (``ensemble.files.state_dir``); default
``$XDG_STATE_HOME/hpc-elastic``, i.e. ``~/.local/state/hpc-elastic``. It must be on a filesystem
every node mounts (``$HOME`` is), since an ensemble's servers find each other through it."""
ZK_REPLACES_ENV = "HPC_ELASTIC_ZK_REPLACES"
"""Set by an ensemble's supervisor for a server it starts on a spare node: the myid it replaces."""
ENSEMBLE_FILE = "ensemble.json"
"""The connect-string file of the user's running ensemble, in ``<state dir>/zk/`` (mode 0600)."""
DEFAULT_ZK_SERVERS = 3
"""Servers of ``hpc-elastic zk start``: 3 survive the loss of one."""
ZK_SERVER_COUNTS = (1, 3, 5)
"""The ensemble sizes offered: an even count survives no more losses than the odd one below."""
DEFAULT_ZK_PORTS = (20000, 32767)
"""Where each server picks its client, quorum and election ports: free ones below Linux's
ephemeral range (32768-60999), which outgoing connections never take in the moment between
the pick and ZooKeeper's bind."""
DEFAULT_ZK_MEMORY = "1G"
"""Memory per server node asked of Slurm; the JVM's heap is half of it (``DEFAULT_ZK_HEAP``)."""
DEFAULT_ZK_HEAP = "512m"
DEFAULT_ZK_RESTARTS = 3
"""Times a server whose step died is started again in place (same node, ports and data)."""
DEFAULT_ZK_SPARES = 0
"""Spare nodes ``zk start`` holds in the ensemble's job, each ready to take the place of a
server whose node is lost (docs/cluster-setup.md, "Losing a server"): none unless asked."""
ZK_MAX_SPARES = 2
DEFAULT_ZK_START_TIMEOUT = 300.0
"""Seconds ``zk start`` waits for the ensemble to serve once Slurm has started its job (and
each server waits for its peers to publish their ports)."""
ZK_TICK_MS = 250
"""The ensemble's ``tickTime``. ZooKeeper ends a silent session at the first tick past its
timeout, and a follower reports its sessions' heartbeats to the leader every half tick: a
node lost is noticed up to 1.5 ticks after the session timeout, 0.4 s with this tick (1.5 s
with 1 s, ZooKeeper's own default being 2 s). The limits in ticks (``zoocfg``) are derived from
seconds; the leader's pings to its followers, every half tick, are a few bytes each."""
ZK_MIN_SESSION_MS = 2000
ZK_MAX_SESSION_MS = 60000
ZK_FOUR_LETTER_WORDS = ("srvr", "mntr", "ruok")
"""The only four-letter words the ensemble answers: status, never its configuration."""
