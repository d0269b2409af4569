"""A real tmpfs in a private mount namespace, for the tests of a store that fills or turns read-only.

    with mounted_tmpfs("4m") as fs:         # skipped with a reason where the machine cannot (failed under CI)
        fs.path                             # the tmpfs as this process sees it (/proc/<holder>/root/<dir>)
        fs.inside(["relaunch", ...])        # argv that runs a command in the namespace, where fs.dir is the tmpfs
        fs.fill(); fs.unfill()              # take every free byte with a filler file, give them back
        fs.remount_read_only()

A holder process (``unshare -m --propagation private``, then ``mount -t tmpfs``, then ``sleep``) keeps the
namespace and its mount alive; this process reaches the tmpfs through the holder's root, and a command
runs there through ``nsenter``. The holder is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

FILLER = "filler.bin"


class Tmpfs:
    """One mounted tmpfs of a private mount namespace (see the module doc)."""

    def __init__(self, holder: subprocess.Popen, mount_point: str):
        self.holder, self.dir = holder, mount_point

    @property
    def path(self) -> Path:
        """The tmpfs seen from this process (through the holder's root)."""
        return Path(f"/proc/{self.holder.pid}/root{self.dir}")

    def inside(self, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """``argv`` run in the namespace (where ``self.dir`` is the tmpfs), in ``cwd`` (default: this one's)."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def fill(self) -> int:
        """Take every free byte with a filler file; returns its size."""
        written = 0
        with open(self.path / FILLER, "ab", buffering=0) as fh:
            chunk = b"\0" * 65536
            with contextlib.suppress(OSError):
                while True:
                    written += fh.write(chunk)
            with contextlib.suppress(OSError):  # the last pages: smaller writes
                while True:
                    written += fh.write(b"\0" * 512)
        return written

    def leave_free(self, nbytes: int) -> None:
        """Fill the tmpfs, then give ``nbytes`` back (a save starts, and runs out of space on the way)."""
        size = self.fill()
        os.truncate(self.path / FILLER, max(0, size - nbytes))

    def unfill(self) -> None:
        """Give the filler's bytes back."""
        (self.path / FILLER).unlink()

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def remount_read_only(self) -> None:
        subprocess.run(self.inside(["mount", "-o", "remount,ro", self.dir]), check=True, capture_output=True)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"a private mount namespace with a tmpfs is required under CI: {reason}")
    pytest.skip(f"no private mount namespace with a tmpfs here: {reason}")


@contextlib.contextmanager
def mounted_tmpfs(size: str) -> Iterator[Tmpfs]:
    """A tmpfs of ``size`` (``mount -o size=``: 4m, 512k) in a private mount namespace, for the block."""
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not installed")
    mount_point = tempfile.mkdtemp(prefix="relaunch-tmpfs-")
    holder = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size={size} relaunch-test {mount_point} && echo mounted && exec sleep 3600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if holder.stdout.readline().strip() != "mounted":
            holder.wait(10)
            _unavailable(f"unshare/mount failed: {holder.stderr.read().strip()[:300]}")
        yield Tmpfs(holder, mount_point)
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        with contextlib.suppress(OSError):
            os.rmdir(mount_point)
