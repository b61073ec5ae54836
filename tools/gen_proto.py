#!/usr/bin/env python3
"""Generate the Python gRPC stubs for proto/*.proto into src/servicer/generated/.

Runs grpc_tools.protoc (with the well-known types bundled in grpcio-tools) to
produce *_pb2.py, *_pb2.pyi and *_pb2_grpc.py, then rewrites the generated
top-level imports of sibling modules (``import common_pb2 as ...``) into
package-relative ones (``from . import common_pb2 as ...``) so the output works
as the ``servicer.generated`` package.

Usage: python tools/gen_proto.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "src" / "servicer" / "generated"
INIT_DOC = '"""Generated protobuf/gRPC code lives here, built by tools/gen_proto.py."""\n'


def _well_known_include() -> str:
    """Directory holding google/protobuf/*.proto as shipped with grpcio-tools."""
    try:
        from importlib.resources import files

        return str(files("grpc_tools") / "_proto")
    except Exception:  # pragma: no cover - very old Python / importlib quirks
        import grpc_tools

        return str(Path(grpc_tools.__file__).parent / "_proto")


def _fix_imports(path: Path, modules: set[str]) -> None:
    """Turn ``import X_pb2 as Y`` (X one of ours) into ``from . import X_pb2 as Y``."""
    text = path.read_text()
    pattern = re.compile(r"^import (\w+_pb2)( as \w+)?$", re.MULTILINE)

    def repl(m: re.Match[str]) -> str:
        if m.group(1) not in modules:
            return m.group(0)
        return f"from . import {m.group(1)}{m.group(2) or ''}"

    new = pattern.sub(repl, text)
    if new != text:
        path.write_text(new)


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("gen_proto: grpcio-tools is not installed (pip install grpcio-tools)", file=sys.stderr)
        return 1

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        print(f"gen_proto: no .proto files found in {PROTO_DIR}", file=sys.stderr)
        return 1

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    init = OUT_DIR / "__init__.py"
    if not init.exists():
        init.write_text(INIT_DOC)

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{_well_known_include()}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        *[str(p) for p in protos],
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"gen_proto: protoc failed with exit code {rc} (args: {' '.join(args[1:])})", file=sys.stderr)
        return rc if isinstance(rc, int) and rc > 0 else 1

    modules = {f"{p.stem}_pb2" for p in protos}
    for stem in (p.stem for p in protos):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            out = OUT_DIR / f"{stem}{suffix}"
            if out.exists():
                _fix_imports(out, modules)

    print(f"gen_proto: generated stubs for {', '.join(p.name for p in protos)} in {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
