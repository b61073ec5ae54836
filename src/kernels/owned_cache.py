"""Cache directories the daemon owns. What it loads from a cache (compiled kernels, a
converted tokenizer and its chat template) must have been written by this user alone, so
a directory is used only when it is ours and nobody else may write in it; where the home
cache cannot be used, a fresh private temp directory is made (never a fixed shared path
that another user could create first).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile

from . import envs

logger = logging.getLogger(__name__)


class UntrustedPath(OSError):
    """A cache path this user does not own, or that others may write."""


def _owned(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def owned_dir(path: str) -> str:
    """``path``, created 0700 if missing, once it is a real directory (not a link) owned by
    this user, writable by it and by nobody else; UntrustedPath (an OSError) if not."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or not _owned(st):
        raise UntrustedPath(f"{path} is not a directory owned by uid {os.getuid()} and writable by it alone")
    if not os.access(path, os.W_OK):
        raise UntrustedPath(f"{path} is not writable")
    return path


def is_owned_file(path: str) -> bool:
    """A regular file (not a link) owned by this user that nobody else may write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and _owned(st)


def cache_dir(kind: str) -> str:
    """The cache directory for ``kind`` (``kernels``, ``tokenizers``): the user's cache when
    it is ours alone, else this process's private temp directory."""
    home = os.path.join(envs.cache_home(), "servicer", kind)
    try:
        return owned_dir(home)
    except OSError as e:
        return _private_temp_dir(kind, str(e))


_private_dirs: dict[str, str] = {}  # kind -> this process's temp directory


def _private_temp_dir(kind: str, why: str) -> str:
    path = _private_dirs.get(kind)
    if path is None:
        path = _private_dirs[kind] = tempfile.mkdtemp(prefix=f"servicer-{kind}-")
        logger.warning("the %s cache cannot be used (%s): using %s for this process", kind, why, path)
        atexit.register(_remove, path, os.getpid())
    return path


def _remove(path: str, creator_pid: int) -> None:
    if os.getpid() == creator_pid:  # not from a forked child that inherited the handler
        shutil.rmtree(path, ignore_errors=True)
