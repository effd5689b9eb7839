"""A round's table as ZooKeeper keeps it: compressed, a chunk at a time, each chunk on its own.

Every newcomer reads its round's table whole, so in a join storm of N agents the ensemble
serves N tables of N records; kept compressed, a table of real records is about a fifth of
its bytes. The pure packing first, then the store on a real server.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

from hpc_elastic.rendezvous.api import NodeInfo
from hpc_elastic.rendezvous.state import encode_table
from hpc_elastic.rendezvous.zookeeper import (
    TABLE_CHUNK,
    ZooKeeperAddress,
    ZooKeeperStore,
    open_client,
    packed,
    unpacked,
)

SECRET = "s3cret"
SESSION = 20.0


def real_table(members: int) -> bytes:
    """A table of records as agents on a cluster make them: ids of ``<slot>-<pid>-<hex>``,
    an address each, a link port each."""
    return encode_table(
        tuple(
            NodeInfo(
                f"{index}-{100_000 + 7 * index}-{uuid.uuid4().hex[:6]}",
                f"10.1.{index // 256}.{index % 256}",
                8,
                str(index),
                40_000 + index % 2_000,
            )
            for index in range(members)
        )
    )


def test_a_table_of_real_records_is_kept_in_a_fifth_of_its_bytes_a_chunk_at_a_time() -> None:
    table = real_table(8_192)
    chunks = packed(table)
    assert len(chunks) == -(-len(table) // TABLE_CHUNK)
    assert sum(map(len, chunks)) < len(table) / 4
    assert [len(zlib.decompress(chunk)) for chunk in chunks[:-1]] == [TABLE_CHUNK] * (
        len(chunks) - 1
    ), "each chunk inflates alone"
    assert unpacked(chunks) == table


def test_chunks_that_cannot_be_smaller_stay_within_one_request() -> None:
    noise = b"".join(uuid.uuid4().bytes for _ in range(2**21 // 16))
    chunks = packed(noise)
    assert max(map(len, chunks)) < TABLE_CHUNK + 1024 < 2**20
    assert unpacked(chunks) == noise


def test_an_empty_table_is_one_chunk_that_reads_back_empty() -> None:
    assert unpacked(packed(b"")) == b""


@pytest.mark.parametrize(
    "chunk",
    [
        pytest.param(b"[not compressed]", id="plain bytes"),
        pytest.param(zlib.compress(b"x" * 1000)[:-4], id="a stream cut short"),
        pytest.param(zlib.compress(b"x" * 1000) + b"more", id="bytes after the stream"),
        pytest.param(zlib.compress(bytes(TABLE_CHUNK + 1)), id="more than a chunk inflated"),
        pytest.param(zlib.compress(bytes(2**30), 9), id="a gigabyte in a megabyte"),
    ],
)
def test_a_chunk_that_is_no_whole_stream_of_one_chunk_makes_no_table(chunk: bytes) -> None:
    good = packed(b"n1,n2")[0]
    assert unpacked([good, chunk]) is None
    assert unpacked([chunk]) is None


# --- on a real server ------------------------------------------------------------------------


class Job:
    """Stores of one job, and a client of its own to look at (and damage) what they keep."""

    def __init__(self, hosts: str) -> None:
        self.address = ZooKeeperAddress.parse(f"{hosts}/tables-{uuid.uuid4().hex}")
        self.stores: list[ZooKeeperStore] = []
        self.client: KazooClient = open_client(self.address, SECRET, SESSION)

    def store(self) -> ZooKeeperStore:
        """A store on a connection of its own: it holds no table read by another."""
        client = open_client(self.address, SECRET, SESSION)
        made = ZooKeeperStore(client, self.address, "job", SECRET)
        self.stores.append(made)
        return made

    def chunks(self, round_number: int, digest: str) -> list[str]:
        path = f"{self.address.job_path('job')}/rounds/{round_number}/{digest}"
        return [f"{path}/{name}" for name in sorted(self.client.get_children(path))]

    def release(self) -> None:
        for store in self.stores:
            store.release()
        self.client.stop()
        self.client.close()


@pytest.fixture
def job(private_zookeeper: str) -> Iterator[Job]:
    made = Job(private_zookeeper)
    yield made
    made.release()


def test_the_store_keeps_a_table_compressed_and_every_connection_reads_it_whole(
    job: Job,
) -> None:
    table = real_table(16_384)
    digest = job.store().put_table(1, table)
    kept = [job.client.get(path)[0] for path in job.chunks(1, digest)]
    assert sum(map(len, kept)) < len(table) / 4
    assert job.store().table(1, digest) == table


def test_chunks_of_one_table_made_by_two_different_compressors_read_as_that_table(
    job: Job,
) -> None:
    """Two proposers of one table on two machines each fill in the chunks missing, and
    their zlib may not make the same bytes: here the first chunk is made at another level."""
    table = real_table(8_192)
    digest = job.store().put_table(1, table)
    first = job.chunks(1, digest)[0]
    other = zlib.compress(table[:TABLE_CHUNK], 1)
    assert other != job.client.get(first)[0]
    job.client.set(first, other)
    assert job.store().table(1, digest) == table


def test_a_damaged_chunk_reads_as_no_table_and_raises_nothing(job: Job) -> None:
    table = real_table(8_192)
    digest = job.store().put_table(1, table)
    job.client.set(job.chunks(1, digest)[-1], zlib.compress(bytes(2**24), 9))
    assert job.store().table(1, digest) is None
