"""Where checkpoints are (a local path or an fsspec URL, decided once) and which format a saved one has."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.location import LocalLocation, Location, RemoteLocation, location_of


@pytest.fixture
def memory_dir() -> Iterator[str]:
    url = f"memory://locations-{uuid.uuid4().hex[:8]}"
    yield url
    storage.remove_data(url)


@pytest.fixture(params=["local", "url"])
def folder(request, tmp_path, memory_dir) -> Location:  # type: ignore[no-untyped-def]
    return location_of(tmp_path / "run" if request.param == "local" else f"{memory_dir}/run")


def test_a_path_is_decided_once_and_named_as_given() -> None:
    local, url = location_of("file:///tmp/run/last.ckpt"), location_of("s3://bucket/run/last.ckpt")
    assert isinstance(local, LocalLocation) and not local.remote and local.value == Path("/tmp/run/last.ckpt")
    assert isinstance(url, RemoteLocation) and url.remote and url.value == "s3://bucket/run/last.ckpt"
    assert location_of(url) is url  # a Location is kept as it is, never decided again
    assert str(url.parent) == "s3://bucket/run" and url.name == "last.ckpt"
    assert url.parent.join("last.ckpt") == url and local.parent.join("last.ckpt") == local
    assert str(local) == "/tmp/run/last.ckpt" and local.name == "last.ckpt"
    assert location_of(Path("s3://bucket/x")).remote is False  # a Path has collapsed the URL already


def test_a_local_folder_and_a_url_answer_alike(folder: Location) -> None:
    checkpoint = folder.join("last.ckpt")
    assert not checkpoint.exists() and not checkpoint.is_file()
    folder.makedirs()
    checkpoint.write_bytes(b"first")
    checkpoint.write_bytes(b"second")  # replaced whole
    assert checkpoint.exists() and checkpoint.is_file() and not checkpoint.is_dir()
    assert checkpoint.read_bytes() == b"second" and checkpoint.readable()
    with checkpoint.open("rb") as stream:
        assert stream.read() == b"second"
    folder.join("shards").join("__0_0.distcp").write_bytes(b"shard")
    assert sorted(folder.names()) == ["last.ckpt", "shards"] and folder.join("shards").is_dir()
    assert checkpoint.modified() > 0
    folder.join("shards").remove()
    folder.join("shards").remove()  # nothing there: nothing to do
    assert folder.names() == ["last.ckpt"]


def test_free_space_is_known_on_a_local_disk_only(tmp_path, memory_dir) -> None:
    assert location_of(tmp_path / "not" / "yet").free_bytes() > 0  # the nearest folder that exists
    assert location_of(memory_dir).free_bytes() is None
