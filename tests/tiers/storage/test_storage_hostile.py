"""Hostile directories on real files: another user pre-creates the
namespace directory (its name is computable from the config) with links to
our files; we must refuse it and write nothing through the links."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile

import pytest

from kvoffload.tiers.storage.store import StorageError
from storage_helpers import NS, close, open_in_child

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user (nobody)")


def _victims(tmp_path):
    """Two root-owned files and their contents."""
    out = {}
    for name in ("victim-a", "victim-b"):
        p = tmp_path / name
        p.write_bytes(name.encode() * 100)
        out[p] = p.read_bytes()
    return out


def _untouched(victims) -> None:
    for p, data in victims.items():
        assert p.read_bytes() == data, p
        assert p.stat().st_uid == 0


@as_root
def test_directory_planted_by_another_user_is_refused(tmp_path, make_tier):
    victims = _victims(tmp_path)
    a, b = victims
    shared = tempfile.mkdtemp(dir="/tmp")  # tmp_path is root's 0700: nobody could not reach it
    try:
        os.chmod(shared, 0o1777)  # like /tmp
        ns_dir = os.path.join(shared, f"ns-{NS.digest()}")
        nobody = pwd.getpwnam("nobody")
        plant = (f"mkdir -m 0777 {ns_dir} && ln -s {a} {ns_dir}/slab-0.bin && ln -s {b} {ns_dir}/index.tmp"
                 f" && ln -s {b} {ns_dir}/index.log.tmp")
        subprocess.run(["sh", "-c", plant], check=True, user=nobody.pw_uid, group=nobody.pw_gid, timeout=30)
        assert os.stat(ns_dir).st_uid == nobody.pw_uid
        with pytest.raises(StorageError, match=rf"{ns_dir} belongs to uid {nobody.pw_uid}") as e:
            make_tier(path=shared)
        assert "\n" not in str(e.value)
        _untouched(victims)
        assert os.readlink(os.path.join(ns_dir, "slab-0.bin")) == str(a)  # not even the links are touched
    finally:
        shutil.rmtree(shared)


def test_links_in_our_own_directory_are_never_followed(tmp_path, make_tier, pool):
    victims = _victims(tmp_path)
    a, b = victims
    tier = make_tier()
    tier.get_worker(pool)  # the slab files are made with the worker
    d = tier.store.dir
    close(tier)
    for tmp in ("index.tmp", "index.log.tmp", "namespace.json.tmp"):  # temporaries are created exclusively
        os.symlink(b, d / tmp)
    again = make_tier()
    _untouched(victims)
    close(again)
    os.unlink(d / "slab-0.bin")
    os.symlink(a, d / "slab-0.bin")
    with pytest.raises(StorageError, match=r"slab-0.bin is a symbolic link"):
        make_tier()
    _untouched(victims)


def test_directory_writable_by_others_is_refused(make_tier):
    tier = make_tier()
    d = tier.store.dir
    close(tier)
    os.chmod(d, 0o777)
    with pytest.raises(StorageError, match=r"writable by others \(mode 0777\)"):
        make_tier()
    os.chmod(d, 0o700)
    make_tier()


def test_namespace_directory_that_is_a_link_is_refused(tmp_path, make_tier):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    root = tmp_path / "store"
    root.mkdir()
    os.symlink(elsewhere, root / f"ns-{NS.digest()}")
    with pytest.raises(StorageError, match="is a symbolic link"):
        make_tier(path=root)
    assert list(elsewhere.iterdir()) == []


def test_created_files_are_private(make_tier):
    d = make_tier().store.dir
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert not [f for f in os.listdir(d) if f.endswith(".tmp")]




@pytest.mark.parametrize("name", ["namespace.json", "index.log"])
def test_a_fifo_in_our_directory_is_refused_not_waited_on(tmp_path, make_tier, name):
    """Opening a FIFO to read blocks until a writer comes: in a child with a
    time limit, so a regression fails instead of hanging the suite."""
    tier = make_tier(capacity_slots=8)
    d = tier.store.dir
    close(tier)
    os.unlink(d / name)
    os.mkfifo(d / name, 0o600)
    out = open_in_child(tmp_path / "store", 8, timeout=60)
    assert out.returncode == 3 and out.stdout.count("\n") == 1, out
    assert f"{d / name}" in out.stdout and "not a regular file" in out.stdout, out


def _stored_dir(make_tier, pool):
    from storage_helpers import fill, key, store

    tier = make_tier()
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    d = tier.store.dir
    close(tier)
    return d


@pytest.mark.parametrize("name", ["slab-0.bin", "index.log", "namespace.json", "lock"])
def test_a_hard_link_in_our_directory_is_refused(tmp_path, make_tier, pool, name):
    """A second name of one of our files (maybe another user's, in a shared
    directory) would be written through: refused by its link count."""
    d = _stored_dir(make_tier, pool)
    other = tmp_path / "other-name"
    os.link(d / name, other)
    before = other.read_bytes()
    with pytest.raises(StorageError, match=rf"{d / name} has 2 hard links") as e:
        make_tier()
    assert "\n" not in str(e.value)
    assert other.read_bytes() == before
    other.unlink()
    close(make_tier())  # the other name gone: served again


@as_root
@pytest.mark.parametrize("name", ["slab-0.bin", "index.log", "namespace.json", "lock"])
def test_a_file_of_another_user_in_our_directory_is_refused(make_tier, pool, name):
    """index.log and namespace.json are refused like the slabs: another user's
    file decides what is served (or is written through)."""
    d = _stored_dir(make_tier, pool)
    nobody = pwd.getpwnam("nobody")
    os.chown(d / name, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(StorageError, match=rf"{d / name} is not a regular file of this user") as e:
        make_tier()
    assert "\n" not in str(e.value)
    assert os.stat(d / name).st_uid == nobody.pw_uid  # left as it is
    os.chown(d / name, 0, 0)
    close(make_tier())
