"""What the daemon loads from its caches was written by its own user alone, and GetTokenizer
ships only the model's own files: a compiled kernel or a converted tokenizer planted in a
shared temp path, or in a cache directory others may write, is never used; a tokenizer
file linked to something outside the model's directory is never shipped."""

from __future__ import annotations

import glob
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile

import grpc
import pytest
import torch
import transformers

from helpers import SRC_DIR, Daemon, scheduler_stub
from kernels import cpu_kernels, owned_cache
from scheduler import model_source
from scheduler.model_source import TOKENIZER_FILES, prepare_tokenizer_dir, resolve_model
from servicer import tokenizer_bundle
from servicer.tokenizer_bundle import build_bundle
from test_model_parity import COMMON

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


def test_a_cache_below_a_directory_others_may_change_is_refused(tmp_path):
    """Others who may rename entries of a parent could swap our directory for theirs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(OSError):
        owned_cache.owned_dir(str(shared / "servicer" / "kernels"))
    linked = tmp_path / "home-cache"  # an ancestor that links into the shared directory
    os.chmod(shared, 0o777)
    (shared / "real").mkdir(mode=0o700)
    linked.symlink_to(shared / "real")
    with pytest.raises(OSError):
        owned_cache.owned_dir(str(linked / "servicer" / "kernels"))
    os.chmod(shared, 0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    assert owned_cache.owned_dir(str(shared / "servicer" / "kernels"))


EXIT_WITHOUT_TEARDOWN = """
from kernels import owned_cache
from scheduler import process
print(owned_cache.cache_dir("kernels"), flush=True)
process._exit_without_teardown(0)
"""


def test_the_private_temp_cache_goes_with_a_process_ending_in_os_exit(tmp_path):
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=str(SRC_DIR), XDG_CACHE_HOME=str(unusable_home(tmp_path)))
    env["TMPDIR"] = str(tmp_path / "tmp")
    p = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_TEARDOWN], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    private = p.stdout.strip()
    assert private.startswith(str(tmp_path / "tmp")), private
    assert not os.path.exists(private)


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


# ------------------------------------------------------------------ GetTokenizer


SECRET = "root:secret-hash:19000:0:99999:7:::"


@pytest.fixture
def outside_secret(tmp_path):
    path = tmp_path / "outside" / "shadow"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def hf_tokenizer_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text('{"model": {}}')
    (path / "tokenizer_config.json").write_text("{}")
    return path


def zip_names(data: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return zf.namelist()


def test_a_link_out_of_the_model_directory_is_not_shipped(tmp_path, outside_secret):
    d = hf_tokenizer_dir(tmp_path / "model")
    (d / "secret.model").symlink_to(outside_secret)
    with pytest.raises(ValueError) as refused:
        build_bundle(str(d))
    assert isinstance(refused.value, tokenizer_bundle.UnshippableFile)
    (d / "secret.model").unlink()
    (d / "chat_template.jinja").symlink_to(tmp_path / "outside")  # a link to a directory: not a file
    (d / "merges.txt").symlink_to(d / "tokenizer.json")  # a link inside: fine
    data, _ = build_bundle(str(d))
    assert sorted(zip_names(data)) == ["merges.txt", "tokenizer.json", "tokenizer_config.json"]


def test_an_hf_cache_snapshot_ships_its_blobs(tmp_path, outside_secret):
    """``snapshots/<rev>/<file> -> ../../blobs/<hash>``: the repository's own blobs ship;
    a link out of the repository does not."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "aaaa").write_text('{"model": {}}')
    (repo / "blobs" / "bbbb").write_text("{}")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to("../../blobs/aaaa")
    (snapshot / "tokenizer_config.json").symlink_to("../../blobs/bbbb")
    data, sha256 = build_bundle(str(snapshot))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("tokenizer.json") == b'{"model": {}}'
    assert build_bundle(str(snapshot))[1] == sha256, "the same files make the same bundle"
    (snapshot / "tokenizer.model").symlink_to(outside_secret)
    with pytest.raises(ValueError):
        build_bundle(str(snapshot))


def test_a_file_over_the_size_cap_is_not_shipped(tmp_path, monkeypatch):
    d = hf_tokenizer_dir(tmp_path / "model")
    monkeypatch.setattr(tokenizer_bundle, "MAX_FILE_BYTES", 8, raising=False)
    with pytest.raises(ValueError):
        build_bundle(str(d))


@pytest.fixture(scope="module")
def tiny_checkpoint_with_a_link_out(tmp_path_factory):
    """A random 2-layer Llama checkpoint with SmolLM2's tokenizer files and a
    ``secret.model`` linked to a file outside its directory."""
    path = tmp_path_factory.mktemp("tiny-llama-link")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON), dtype=torch.float32)
    hf.save_pretrained(path)
    tokenizer_dir = prepare_tokenizer_dir(resolve_model("smollm2"))
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path / name)
    secret = tmp_path_factory.mktemp("outside") / "shadow"
    secret.write_text(SECRET)
    (path / "secret.model").symlink_to(secret)
    return path, secret


def test_get_tokenizer_of_a_daemon_refuses_a_link_out(tiny_checkpoint_with_a_link_out, tmp_path):
    from smg_grpc_proto.generated import common_pb2

    path, secret = tiny_checkpoint_with_a_link_out
    with Daemon(model=str(path), kv_cache_tokens=2048, log_dir=tmp_path) as d, scheduler_stub(d.address) as stub:
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=120))
        log = d.log_path.read_text()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
    assert str(secret) not in refused.value.details() and str(path) not in refused.value.details()
    assert str(path / "secret.model") in log, "the daemon's log should name the file"
