"""The GetTokenizer bundle: a flat ZIP of the tokenizer files, built once and cached.

The router asks for it when it cannot read our tokenizer path itself; it needs the
chat template in the bundle to serve /v1/chat/completions.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import zipfile

CHUNK_BYTES = 64 * 1024
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


def build_bundle(tokenizer_dir: str) -> tuple[bytes, str]:
    """ZIP (deflate, flat names) of the tokenizer files in ``tokenizer_dir`` and its sha256 hex."""
    names = sorted(
        n for n in os.listdir(tokenizer_dir) if _wanted(n) and os.path.isfile(os.path.join(tokenizer_dir, n))
    )
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(os.path.join(tokenizer_dir, name), arcname=name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, size: int = CHUNK_BYTES):
    for start in range(0, len(data), size):
        yield data[start : start + size]
