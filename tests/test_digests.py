"""Digests that outlive the process (featcal_core/io/digests.py): a second process does not read
a large file again to hash it; a changed file (even with its size and mtime put back) or a
disabled store is read again."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from featcal_core.io.outputs import sha256_file
def read_bytes():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])
before = read_bytes()
digest = sha256_file(sys.argv[1])
print(json.dumps({"sha256": digest, "read": read_bytes() - before}))
"""

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")


def _hash_in_new_process(path, store) -> dict:
    env = {**os.environ, "FEATCAL_DIGEST_CACHE": str(store)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


def test_second_process_reuses_the_digest_until_the_file_changes(tmp_path):
    path = tmp_path / "weights.bin"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    store = tmp_path / "cache" / "digests.sqlite"

    first = _hash_in_new_process(path, store)
    assert first["sha256"] == hashlib.sha256(data).hexdigest()
    assert first["read"] >= len(data)
    second = _hash_in_new_process(path, store)
    assert second["sha256"] == first["sha256"] and second["read"] < len(data) // 4

    st = os.stat(path)  # same size, mtime put back: ctime still moves
    changed = bytes([data[0] ^ 1]) + data[1:]
    path.write_bytes(changed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = _hash_in_new_process(path, store)
    assert third["sha256"] == hashlib.sha256(changed).hexdigest() and third["read"] >= len(data)

    off = _hash_in_new_process(path, "off")
    assert off["sha256"] == third["sha256"] and off["read"] >= len(data)


def test_an_unusable_store_only_costs_a_rehash(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(2 << 20))
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the store's folder should be")
    result = _hash_in_new_process(path, blocked / "digests.sqlite")
    assert result["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_hashing_in_background_leaves_the_digests_for_the_record(tmp_path, monkeypatch):
    from featcal_core.io import digests

    monkeypatch.setenv("FEATCAL_DIGEST_CACHE", "off")
    files = []
    for number in range(3):
        path = tmp_path / f"w{number}.bin"
        path.write_bytes(os.urandom(1 << 16) * (number + 1))
        files.append(path)
    wait = digests.hash_in_background([*files, tmp_path / "missing.bin"])  # skipped, no raise
    wait()
    for path in files:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        assert digests._DIGESTS[key] == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(FileNotFoundError):  # the caller still meets the error itself
        digests.sha256_file(tmp_path / "missing.bin")
