"""What the daemon loads from its caches was written by its own user alone: a compiled
kernel or a converted tokenizer planted in a shared temp path, or in a cache directory
others may write, is never used."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import SRC_DIR
from kernels import cpu_kernels, owned_cache
from scheduler import model_source
from scheduler.model_source import prepare_tokenizer_dir

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("PLANTED_MARKER");
    FILE *f = marker ? fopen(marker, "w") : NULL;
    if (f) { fputs("ran inside the daemon", f); fclose(f); }
}
"""

LOAD_FUSED_OPS = """
from kernels import cpu_kernels
lib = cpu_kernels.load_library("fused_ops")
print(lib._name if lib is not None else "")
"""


def kernel_file_name(name: str = "fused_ops") -> str:
    """The cache file name load_library gives ``name``'s fp32 build (keyed on flags, CPU and sources)."""
    flags = cpu_kernels.CFLAGS + cpu_kernels.ELEMENT_FLAGS[torch.float32]
    digest = hashlib.sha256(" ".join(flags).encode() + cpu_kernels._cpu_signature().encode())
    for path in [
        os.path.join(cpu_kernels.CSRC, f"{name}.c"),
        *sorted(glob.glob(os.path.join(cpu_kernels.CSRC, "*.h"))),
    ]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"{name}-f32-{digest.hexdigest()[:16]}.so"


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory):
    """A shared library whose constructor writes the file $PLANTED_MARKER names."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED_C)
    subprocess.run([cc, "-shared", "-fPIC", str(d / "planted.c"), "-o", str(d / "planted.so")], check=True)
    return d / "planted.so"


def plant(library, where) -> str:
    where.mkdir(parents=True, exist_ok=True)
    target = where / kernel_file_name()
    shutil.copy(library, target)
    return str(target)


def load_fused_ops(tmp_path, xdg_cache_home, cc: str | None = None) -> tuple[str, bool]:
    """load_library("fused_ops") in a fresh process: (the loaded file, whether the planted
    constructor ran)."""
    marker = tmp_path / "planted-ran"
    env = dict(os.environ, PYTHONPATH=str(SRC_DIR), XDG_CACHE_HOME=str(xdg_cache_home))
    env.update(TMPDIR=str(tmp_path / "tmp"), PLANTED_MARKER=str(marker))
    env.pop("SERVICER_DISABLE_NATIVE_KERNELS", None)
    if cc is not None:
        env["CC"] = cc
    p = subprocess.run([sys.executable, "-c", LOAD_FUSED_OPS], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip(), marker.exists()


def unusable_home(tmp_path):
    """An XDG_CACHE_HOME nobody can create (below a plain file), even as root."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "cache"


def test_a_kernel_planted_in_the_shared_temp_path_is_not_loaded(tmp_path, planted_library):
    planted = plant(planted_library, tmp_path / "tmp" / f"servicer-kernels-{os.getuid()}")
    loaded, ran = load_fused_ops(tmp_path, unusable_home(tmp_path))
    assert not ran, "the planted library's constructor ran"
    assert loaded and loaded != planted, "the kernel should be built in a private directory of its own"
    assert os.path.basename(os.path.dirname(loaded)).startswith("servicer-kernels-")
    assert not os.path.exists(loaded), "the private directory goes with the process"


def test_a_kernel_file_others_may_write_is_built_again_not_loaded(tmp_path, planted_library):
    xdg = tmp_path / "xdg"
    planted = plant(planted_library, xdg / "servicer" / "kernels")
    os.chmod(planted, 0o666)
    loaded, ran = load_fused_ops(tmp_path, xdg)
    assert not ran, "the planted library's constructor ran"
    assert loaded == planted, "the cache directory is ours: the kernel is rebuilt in its place"
    assert not os.stat(planted).st_mode & 0o022, "the rebuilt file is writable by this user alone"


def test_a_cache_directory_others_may_write_is_refused(tmp_path, planted_library):
    xdg = tmp_path / "xdg"
    planted = plant(planted_library, xdg / "servicer" / "kernels")
    os.chmod(xdg / "servicer" / "kernels", 0o777)
    loaded, ran = load_fused_ops(tmp_path, xdg, cc="false")  # (no build needed to show it)
    assert not ran and loaded != planted
    for mode in (0o777, 0o770, 0o757):
        d = tmp_path / f"dir-{mode:o}"
        d.mkdir()
        os.chmod(d, mode)
        with pytest.raises(OSError):
            owned_cache.owned_dir(str(d))
    assert owned_cache.owned_dir(str(tmp_path / "fresh" / "cache")) == str(tmp_path / "fresh" / "cache")
    assert os.stat(tmp_path / "fresh" / "cache").st_mode & 0o777 == 0o700


# ------------------------------------------------------------------ the converted-tokenizer cache


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A GGUF path whose (stubbed) conversion writes a tokenizer.json saying "converted",
    with the temp dir and the per-process fallback of this test's own."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(owned_cache, "_private_dirs", {}, raising=False)

    def convert(gguf_path, out_dir):
        with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
            f.write("converted")

    monkeypatch.setattr(model_source, "_build_gguf_tokenizer", convert)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def plant_tokenizer(root, gguf_path) -> str:
    entry = root / model_source._gguf_tokenizer_name(gguf_path)
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("planted")
    return str(entry)


def assert_converted(entry: str) -> None:
    with open(os.path.join(entry, "tokenizer.json")) as f:
        assert f.read() == "converted"


def test_a_tokenizer_entry_in_the_shared_temp_path_is_not_used(tmp_path, monkeypatch, gguf):
    planted = plant_tokenizer(tmp_path / "tmp" / f"servicer-tokenizers-{os.getuid()}", gguf)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    entry = prepare_tokenizer_dir(gguf)
    assert entry != planted and entry.startswith(str(tmp_path / "xdg"))
    assert_converted(entry)
    monkeypatch.setenv("XDG_CACHE_HOME", str(unusable_home(tmp_path)))
    entry = prepare_tokenizer_dir(gguf)
    assert entry != planted
    assert_converted(entry)
    assert os.stat(os.path.dirname(entry)).st_mode & 0o777 == 0o700


def test_a_tokenizer_cache_others_may_write_is_not_used(tmp_path, monkeypatch, gguf):
    root = tmp_path / "xdg" / "servicer" / "tokenizers"
    planted = plant_tokenizer(root, gguf)
    os.chmod(root, 0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    entry = prepare_tokenizer_dir(gguf)
    assert entry != planted and not entry.startswith(str(root))
    assert_converted(entry)
