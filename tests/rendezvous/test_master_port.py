"""The workers' MASTER_PORT when rank 0's own store is not open yet (``handler.free_port``):
picked now, bound by rank 0 moments later, so never from the ports that outgoing connections
take their local ports from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hpc_elastic import contract
from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous.handler import free_port, unraced_ports


def ephemeral(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{text}\n")
    return path


@pytest.mark.parametrize(
    ("kernel", "unraced"),
    [
        ("32768\t60999", (20000, 32767)),  # Linux's default
        ("40000 60999", (20000, 32767)),
        ("10000 25000", (25001, 32767)),  # the ports above the range are left
        ("1024 65535", (0, 0)),  # no port outside it: any free port
        ("15000 32767", (0, 0)),
        ("not a range", (0, 0)),
    ],
)
def test_the_default_ports_are_those_outside_the_kernels_ephemeral_range(
    tmp_path: Path, kernel: str, unraced: tuple[int, int]
) -> None:
    assert unraced_ports(ephemeral(tmp_path, kernel)) == unraced


def test_an_unreadable_ephemeral_range_leaves_any_free_port(tmp_path: Path) -> None:
    assert unraced_ports(tmp_path / "missing") == (0, 0)


def test_without_a_site_range_the_port_lies_below_the_ephemeral_range(tmp_path: Path) -> None:
    kernel = ephemeral(tmp_path, "32768 60999")
    low, high = contract.DEFAULT_MASTER_PORTS
    ports = [free_port({}, kernel) for _ in range(20)]
    assert all(low <= port <= high for port in ports), ports


def test_with_every_port_below_the_range_taken_any_free_port_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(contract, "DEFAULT_MASTER_PORTS", (taken, taken))
        kernel = ephemeral(tmp_path, f"{taken + 1} 60999")
        assert unraced_ports(kernel) == (taken, taken)
        port = free_port({}, kernel)
    assert port not in (0, taken)


def test_a_site_range_with_no_free_port_is_one_sentence_naming_it() -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        held.listen()
        with pytest.raises(RendezvousError, match=f"'{taken}:{taken}'.*--master-port-range"):
            free_port({contract.MASTER_PORTS_ENV: f"{taken}:{taken}"})
