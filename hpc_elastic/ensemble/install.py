"""Finding the user's ZooKeeper and Java: hpc-elastic brings the ensemble, not the software.

ZooKeeper is looked for, in this order (the first that holds a ZooKeeper jar wins):

1. ``$ZOOKEEPER_HOME``, an unpacked Apache release (``lib/zookeeper-*.jar``) or an old one
   (``zookeeper-*.jar`` at the top); a ``$ZOOKEEPER_HOME`` that holds neither is an error;
2. ``zkServer.sh`` or ``zkServer`` on ``PATH`` (a module, a conda environment, Homebrew): the
   directory above its ``bin/``, or ``libexec/``, ``share/zookeeper``, ``libexec/zookeeper`` or
   ``lib/zookeeper`` there;
3. Debian's and Ubuntu's package: ``/usr/share/java/zookeeper.jar``, whose manifest names the
   jars it needs;
4. ``$CONDA_PREFIX``, laid out as in 2.

Java is ``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``. The search is pure over a
``FileSystem`` (``tests/ensemble/test_ensemble.py`` runs it on a fake one); what is missing is one
sentence naming it and the ways to get it.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from hpc_elastic.errors import EnsembleError

DEBIAN_JAR = "/usr/share/java/zookeeper.jar"
SCRIPTS = ("zkServer.sh", "zkServer")
HOMES_BESIDE_BIN = ("", "libexec", "share/zookeeper", "libexec/zookeeper", "lib/zookeeper")
"""Where a ZooKeeper home may lie relative to the directory above a ``bin/zkServer.sh``."""

_GET_ZOOKEEPER = (
    "`module load zookeeper`, `conda install -c conda-forge zookeeper`, or your "
    "distribution's package (e.g. `apt install zookeeper`), or set ZOOKEEPER_HOME to an "
    "unpacked Apache ZooKeeper"
)
_GET_JAVA = (
    "`module load java`, `conda install -c conda-forge openjdk`, or your distribution's "
    "package (e.g. `apt install default-jre-headless`), or set JAVA_HOME"
)
_NO_ZOOKEEPER = (
    "ZooKeeper (ZOOKEEPER_HOME is unset, no zkServer.sh or zkServer is on PATH, and neither "
    f"{DEBIAN_JAR} nor a conda environment's ZooKeeper exists)"
)
_NO_JAVA = "Java (JAVA_HOME is unset and no java is on PATH)"


class FileSystem(Protocol):
    """The few questions the search asks of the filesystem."""

    def is_dir(self, path: str) -> bool: ...
    def is_file(self, path: str) -> bool: ...
    def executable(self, path: str) -> bool: ...
    def glob(self, pattern: str) -> list[str]: ...
    def realpath(self, path: str) -> str: ...
    def which(self, name: str, search_path: str) -> str | None: ...


class RealFileSystem:
    """This machine's filesystem."""

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def executable(self, path: str) -> bool:
        return os.path.isfile(path) and os.access(path, os.X_OK)

    def glob(self, pattern: str) -> list[str]:
        return sorted(glob.glob(pattern))

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def which(self, name: str, search_path: str) -> str | None:
        return shutil.which(name, path=search_path)


@dataclass(frozen=True)
class Installation:
    """What a server runs: ``java -cp <classpath> org.apache.zookeeper...``."""

    java: str
    classpath: str
    zookeeper: str
    """Where ZooKeeper was found, for messages (``$ZOOKEEPER_HOME /opt/zk``, ...)."""


def zookeeper_classpath(home: str, fs: FileSystem) -> str | None:
    """The classpath of a ZooKeeper home, or None when it holds no ZooKeeper jar: its
    ``conf/`` first (the logging settings, as zkEnv.sh does), then its jars."""
    home = home.rstrip("/") or "/"
    in_lib = fs.glob(f"{home}/lib/zookeeper-*.jar")
    at_top = fs.glob(f"{home}/zookeeper-*.jar")
    if not in_lib and not at_top:
        return None
    parts = [f"{home}/conf"] if fs.is_dir(f"{home}/conf") else []
    if in_lib:
        parts.append(f"{home}/lib/*")  # java expands ``dir/*`` to every jar in it
    parts.extend(at_top)
    return ":".join(parts)


def find_zookeeper(environ: Mapping[str, str], fs: FileSystem) -> tuple[str, str] | None:
    """(classpath, where it was found), or None when no ZooKeeper is anywhere the search
    looks; a ``$ZOOKEEPER_HOME`` without ZooKeeper raises, since the user named it."""
    home = environ.get("ZOOKEEPER_HOME")
    if home:
        classpath = zookeeper_classpath(home, fs)
        if classpath is None:
            raise EnsembleError(
                f"ZOOKEEPER_HOME '{home}' holds no ZooKeeper jar (lib/zookeeper-*.jar); point "
                "it at an unpacked Apache ZooKeeper, or unset it to search PATH."
            )
        return classpath, f"$ZOOKEEPER_HOME {home}"
    search_path = environ.get("PATH", "")
    for script in SCRIPTS:
        found = fs.which(script, search_path)
        if found is None:
            continue
        above_bin = os.path.dirname(os.path.dirname(fs.realpath(found)))
        for relative in HOMES_BESIDE_BIN:
            candidate = os.path.join(above_bin, relative) if relative else above_bin
            classpath = zookeeper_classpath(candidate, fs)
            if classpath is not None:
                return classpath, f"{script} on PATH ({candidate})"
    if fs.is_file(DEBIAN_JAR):
        return DEBIAN_JAR, f"the distribution's package ({DEBIAN_JAR})"
    prefix = environ.get("CONDA_PREFIX")
    if prefix:
        for relative in HOMES_BESIDE_BIN:
            candidate = os.path.join(prefix, relative) if relative else prefix
            classpath = zookeeper_classpath(candidate, fs)
            if classpath is not None:
                return classpath, f"the conda environment {prefix}"
    return None


def find_java(environ: Mapping[str, str], fs: FileSystem) -> str | None:
    """``$JAVA_HOME/bin/java``, else ``java`` on PATH; a ``$JAVA_HOME`` without it raises."""
    home = environ.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        if not fs.executable(java):
            raise EnsembleError(
                f"JAVA_HOME '{home}' has no executable bin/java; point it at a Java runtime "
                "(11 or newer), or unset it to use the java on PATH."
            )
        return java
    return fs.which("java", environ.get("PATH", ""))


def find_installation(
    environ: Mapping[str, str] = os.environ, fs: FileSystem | None = None
) -> Installation:
    """The user's ZooKeeper and Java, or one sentence naming what is missing and how to get
    it (both at once when both are missing)."""
    fs = RealFileSystem() if fs is None else fs
    zookeeper = find_zookeeper(environ, fs)
    java = find_java(environ, fs)
    if zookeeper is None and java is None:
        raise EnsembleError(
            f"Neither {_NO_ZOOKEEPER} nor {_NO_JAVA} was found; get ZooKeeper with "
            f"{_GET_ZOOKEEPER}, and Java with {_GET_JAVA}."
        )
    if zookeeper is None:
        raise EnsembleError(f"{_NO_ZOOKEEPER} was not found; get it with {_GET_ZOOKEEPER}.")
    if java is None:
        raise EnsembleError(f"{_NO_JAVA} was not found; get it with {_GET_JAVA}.")
    classpath, where = zookeeper
    return Installation(java=java, classpath=classpath, zookeeper=where)
