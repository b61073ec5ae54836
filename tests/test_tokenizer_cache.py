"""The converted-tokenizer cache of GGUF models: one entry per GGUF file, published
whole, and pruned of entries whose GGUF is gone or changed (deleted checkouts and venvs)."""

from __future__ import annotations

import json
import os
import time

from scheduler import model_source
from scheduler.model_source import SOURCE_RECORD, prepare_tokenizer_dir, prune_tokenizer_cache, resolve_model


def entry(root, name, source: dict | None = None, age_s: float = 0.0):
    path = root / name
    path.mkdir(parents=True)
    if source is not None:
        (path / SOURCE_RECORD).write_text(json.dumps(source))
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def test_prune_removes_only_unused_entries_whose_gguf_is_gone_or_changed(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    root = tmp_path / "cache"
    current = model_source._gguf_identity(str(gguf))
    day = model_source.UNUSED_S
    live = entry(root, "live", current, age_s=2 * day)
    gone = entry(root, "gone", dict(current, path=str(tmp_path / "deleted.gguf")), age_s=2 * day)
    changed = entry(root, "changed", dict(current, mtime_ns=current["mtime_ns"] - 1), age_s=2 * day)
    recent = entry(root, "gone-but-used-today", dict(current, path=str(tmp_path / "deleted.gguf")))
    unknown = entry(root, "no-record", age_s=2 * day)  # not ours to judge: kept
    crashed = entry(root, ".tmp-crashed", age_s=2 * model_source.STALE_TMP_S)
    running = entry(root, ".tmp-running")  # a conversion in progress elsewhere
    assert prune_tokenizer_cache(str(root)) == 3
    kept = (live, recent, unknown, running)
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in kept)
    assert not gone.exists() and not changed.exists() and not crashed.exists()
    assert prune_tokenizer_cache(str(tmp_path / "missing")) == 0


def test_a_conversion_records_its_source_and_prunes_a_deleted_copy(tmp_path, monkeypatch):
    """(The conversion itself is stubbed: the daemon's start-up runs the real one.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(
        model_source, "_build_gguf_tokenizer", lambda gguf, out: open(f"{out}/tokenizer.json", "w").close()
    )
    bundled = resolve_model("smollm2")
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for link in (first, second):  # two "checkouts" of the same file
        link.parent.mkdir()
        link.symlink_to(bundled)
    one = prepare_tokenizer_dir(str(first))
    assert json.loads(open(os.path.join(one, SOURCE_RECORD)).read())["path"] == str(first)
    day_ago = time.time() - model_source.UNUSED_S - 60
    os.utime(one, (day_ago, day_ago))
    assert prepare_tokenizer_dir(str(first)) == one, "a hit reuses the entry"
    assert os.stat(one).st_mtime > day_ago + 60, "a hit marks the entry used"
    os.utime(one, (day_ago, day_ago))
    first.unlink()  # the first checkout is deleted, and its entry unused for a day
    two = prepare_tokenizer_dir(str(second))
    assert two != one and os.path.isfile(os.path.join(two, "tokenizer.json"))
    assert not os.path.exists(one), "the deleted checkout's entry should be pruned"
