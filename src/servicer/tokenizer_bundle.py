"""The GetTokenizer bundle: a flat ZIP of the tokenizer files, built once and cached.

The router asks for it when it cannot read our tokenizer path itself; it needs the
chat template in the bundle to serve /v1/chat/completions.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import stat
import time
import zipfile

CHUNK_BYTES = 64 * 1024
# Per file: the largest tokenizer files known (a tokenizer.json of a 256k vocabulary with
# its merges) are tens of MB; a file several times that is not a tokenizer.
MAX_FILE_BYTES = 64 * 2**20
ZIP_EPOCH = 315532800 + 86400  # 1980-01-02 UTC: a ZIP cannot date a file before 1980
BUNDLE_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
}
BUNDLE_GLOBS = ("*.tiktoken", "*.jinja", "*.model")


def _wanted(name: str) -> bool:
    return name in BUNDLE_FILES or any(fnmatch.fnmatch(name, g) for g in BUNDLE_GLOBS)


class UnshippableFile(ValueError):
    """A tokenizer file that resolves outside the model's directory, is not a regular file,
    or is too large to ship. (The message names the path: for the daemon's log only.)"""


def _shippable_roots(tokenizer_dir: str) -> list[str]:
    """Where the real paths of shipped files may lie: the directory itself and, for an HF
    cache snapshot (``<repo>/snapshots/<rev>/<file> -> ../../blobs/<hash>``), its
    repository's blobs."""
    real = os.path.realpath(tokenizer_dir)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _read_shippable(path: str, roots: list[str]) -> tuple[bytes, os.stat_result]:
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise UnshippableFile(f"{path} resolves to {real}, outside {' and '.join(roots)}")
    # O_NONBLOCK: a FIFO put in the file's place must not hang the open.
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnshippableFile(f"{path} ({real}) is not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise UnshippableFile(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return data, st


def build_bundle(tokenizer_dir: str) -> tuple[bytes, str]:
    """ZIP (deflate, flat names) of the tokenizer files in ``tokenizer_dir`` and its sha256
    hex; UnshippableFile when one of them may not be shipped (nothing is then)."""
    names = sorted(
        n for n in os.listdir(tokenizer_dir) if _wanted(n) and os.path.isfile(os.path.join(tokenizer_dir, n))
    )
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir}")
    roots = _shippable_roots(tokenizer_dir)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            content, st = _read_shippable(os.path.join(tokenizer_dir, name), roots)
            # The file's own time and mode (as ZipFile.write): the same files, the same sha256.
            info = zipfile.ZipInfo(name, time.localtime(max(st.st_mtime, ZIP_EPOCH))[:6])
            info.external_attr = (st.st_mode & 0xFFFF) << 16
            zf.writestr(info, content, compress_type=zipfile.ZIP_DEFLATED)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, size: int = CHUNK_BYTES):
    for start in range(0, len(data), size):
        yield data[start : start + size]
