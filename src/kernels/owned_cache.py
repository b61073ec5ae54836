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


def _check_ancestors(path: str) -> None:
    """UntrustedPath unless every directory above ``path`` is owned by this user or root and
    nobody else may rename its entries (not writable by others, or sticky like /tmp): else
    another user could swap an owned cache directory for one of theirs."""
    parent = os.path.dirname(os.path.realpath(path))  # (the directories a linked ancestor leads through)
    while True:
        st = os.stat(parent)
        shared_writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, os.getuid()) or shared_writable:
            raise UntrustedPath(f"{parent} (above {path}) may be changed by other users")
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above


def owned_dir(path: str) -> str:
    """``path``, created 0700 if missing, once it is a real directory (not a link) owned by
    this user, writable by it and by nobody else, below directories nobody else may change;
    UntrustedPath (an OSError) if not."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    _check_ancestors(path)
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
        if not _private_dirs_owner:
            _private_dirs_owner.append(os.getpid())
            atexit.register(remove_private_dirs)
    return path


_private_dirs_owner: list[int] = []  # the pid that made them


def remove_private_dirs() -> None:
    """Remove this process's private temp directories. Runs at exit; a process that ends
    with os._exit (skipping atexit) calls it itself."""
    if _private_dirs_owner and os.getpid() != _private_dirs_owner[0]:
        return  # a forked child that inherited the handler: the directories are not its own
    for path in _private_dirs.values():
        shutil.rmtree(path, ignore_errors=True)
    _private_dirs.clear()
