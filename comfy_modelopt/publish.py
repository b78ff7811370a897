"""Where an output lands: its path checked before any work, written as a hidden partial file in
the destination folder, published by link-or-fail (or replace with ``overwrite``) once complete
and fsynced, with the mode a new file gets under the umask; partials of writers that died are
removed by the next writer, never a live one's (the safetensors writer, ``StreamWriter``, and
``atomic_write_bytes`` for small files both stand on this)."""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile

from .errors import OutputError, OutputExistsError


def check_output_path(path: str, overwrite: bool) -> str:
    """Refuse an output we cannot or must not write, before any work; returns its folder."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder):
        raise OutputError(f"{path}: folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: folder {folder} is not writable")
    if os.path.isdir(path):
        raise OutputError(f"{path} is a folder; give a file name such as {os.path.join(path, 'model.safetensors')}")
    if os.path.lexists(path) and not overwrite:
        raise OutputExistsError(f"{path} already exists (overwrite=True, or --overwrite, replaces it)")
    return folder


def publish(tmp_path: str, path: str, overwrite: bool) -> None:
    """Move a finished temp file into place: replace with ``overwrite``, else link-or-fail, so
    a file that appeared meanwhile (another run) is never replaced."""
    if overwrite:
        if os.path.isdir(path):
            raise OutputError(f"{path} is a folder; choose a file name")
        os.replace(tmp_path, path)
        return
    try:
        os.link(tmp_path, path)       # fails if the target appeared meanwhile
    except FileExistsError:
        raise OutputExistsError(f"{path} appeared while this run was writing (another run?); "
                                f"nothing was replaced - overwrite=True (--overwrite) replaces it") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS,
                           getattr(errno, "ENOTSUP", -1)):
            raise
        # filesystems without hard links: the narrow check-then-rename is the best there is
        if os.path.lexists(path):
            raise OutputExistsError(f"{path} appeared while this run was writing; nothing "
                                    f"was replaced - overwrite=True (--overwrite) replaces it") from None
        os.rename(tmp_path, path)
        return
    os.unlink(tmp_path)


def partial_prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


def partials_of(path: str) -> list[str]:
    """Hidden partial files of writers to ``path`` (live or dead)."""
    folder, prefix = os.path.dirname(os.path.abspath(path)), partial_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith(prefix) and n.endswith(".partial")]


def remove_stale_partials(path: str) -> list[str]:
    """Remove partials of ``path`` left by writers that died (kill -9, power cut): those whose
    lock can be taken; a live writer holds its own.  Returns what was removed."""
    removed = []
    for p in partials_of(path):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live writer
        try:
            if os.pread(fd, 8, 0) == bytes(8):  # ours, never completed
                os.unlink(p)
                removed.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def target_mode(path: str) -> int:
    """The mode the output gets: an existing file's own, else a new file's under the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def atomic_write_bytes(path: str, data: bytes, overwrite: bool = False) -> str:
    """Write a small file (a JSON report) with the same guarantees as ``StreamWriter``: temp
    file, fsync, link-or-fail or replace, umask mode; nothing half-written on any failure."""
    path = os.path.abspath(os.fspath(path))
    folder = check_output_path(path, overwrite)
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(path), suffix=".partial", dir=folder)
    try:
        os.fchmod(fd, target_mode(path))
        pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
        publish(tmp, path, overwrite)
        fsync_dir(folder)
        return path
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)


def reserve(fd: int, size: int, path: str) -> None:
    """Allocate the whole file up front: a full disk fails here, before any work."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OutputError(errno.ENOSPC, f"no space left for {path} ({size / 2**30:.2f} GiB needed)") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
            raise
        os.ftruncate(fd, size)  # filesystems without fallocate


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def fsync_dir(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def check_not_input(path, src, what: str) -> None:
    """Refuse ``path`` when it is the input model (same file through any name or link)."""
    same = os.path.realpath(path) == os.path.realpath(src)
    if not same and os.path.exists(path) and os.path.exists(src):
        same = os.path.samefile(path, src)
    if same:
        raise OutputError(f"{path}: the {what} would overwrite the input model; choose another path")
