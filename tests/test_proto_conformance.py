"""Our proto/*.proto must be wire-identical to smg-grpc-proto 0.4.28 (SGLang scheduler part).

Both sets of .proto sources are compiled with grpc_tools.protoc into FileDescriptorSets and
each set is loaded into its own private DescriptorPool. Nothing here imports generated pb2
modules: ours and smg's register the same symbols in the default pool and would clash.

The comparison walks everything we define (messages with their nested messages and enums,
top-level enums, services) and reports every difference it finds, not only the first.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

ROOT = Path(__file__).resolve().parent.parent
OUR_PROTO_DIR = ROOT / "proto"
PROTO_FILES = ("common.proto", "sglang_scheduler.proto")
# Files whose every top-level definition we must carry; of common.proto we only need what
# sglang_scheduler.proto reaches (checked by test_every_smg_rpc_and_reachable_type_is_ours).
COMPLETE_FILES = ("sglang_scheduler.proto",)
SERVICE = "sglang.grpc.scheduler.SglangScheduler"
WELL_KNOWN_PREFIX = "google/protobuf/"


# --------------------------------------------------------------------------------------
# Building descriptor sets and pools
# --------------------------------------------------------------------------------------


def _well_known_include() -> str:
    from importlib.resources import files

    return str(files("grpc_tools") / "_proto")


def _smg_proto_dir() -> Path:
    # find_spec does not execute the package, so no smg descriptors get registered.
    spec = importlib.util.find_spec("smg_grpc_proto")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("smg-grpc-proto is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations))) / "proto"


def build_descriptor_set(proto_dir: Path, out_dir: Path) -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    out = out_dir / "descriptors.pb"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{_well_known_include()}",
        f"--descriptor_set_out={out}",
        "--include_imports",
        *[str(proto_dir / name) for name in PROTO_FILES],
    ]
    rc = protoc.main(args)
    assert rc == 0, f"protoc failed ({rc}) compiling {proto_dir}"
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    return fds


def load_pool(fds: descriptor_pb2.FileDescriptorSet) -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:  # protoc emits files in dependency order
        pool.AddSerializedFile(f.SerializeToString())
    return pool


def _own_files(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    return [f.name for f in fds.file if not f.name.startswith(WELL_KNOWN_PREFIX)]


# --------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------


def _as_proto(desc, cls):
    p = cls()
    desc.CopyToProto(p)
    return p


def _reserved(ranges) -> list[tuple[int, int]]:
    """Reserved ranges as merged half-open intervals ("1, 2, 3" == "1 to 3")."""
    merged: list[list[int]] = []
    for start, end in sorted((r.start, r.end) for r in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(r) for r in merged]


def _type_name(field) -> str:
    if field.message_type is not None:
        return field.message_type.full_name
    if field.enum_type is not None:
        return field.enum_type.full_name
    return ""


def _is_map(field) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _names_diff(where: str, kind: str, ours, theirs, diffs: list[str]) -> list[str]:
    ours, theirs = set(ours), set(theirs)
    for n in sorted(ours - theirs):
        diffs.append(f"{where}: {kind} {n!r} is ours only (not in smg)")
    for n in sorted(theirs - ours):
        diffs.append(f"{where}: {kind} {n!r} is missing from ours")
    return sorted(ours & theirs)


def _compare_enum(o, t, diffs: list[str]) -> None:
    where = f"enum {o.full_name}"
    ov = {v.name: v.number for v in o.values}
    tv = {v.name: v.number for v in t.values}
    for name in _names_diff(where, "value", ov, tv, diffs):
        if ov[name] != tv[name]:
            diffs.append(f"{where}.{name}: number {ov[name]} != smg {tv[name]}")
    op = _as_proto(o, descriptor_pb2.EnumDescriptorProto)
    tp = _as_proto(t, descriptor_pb2.EnumDescriptorProto)
    if _reserved(op.reserved_range) != _reserved(tp.reserved_range):
        diffs.append(f"{where}: reserved ranges {_reserved(op.reserved_range)} != smg {_reserved(tp.reserved_range)}")
    if sorted(op.reserved_name) != sorted(tp.reserved_name):
        diffs.append(f"{where}: reserved names {sorted(op.reserved_name)} != smg {sorted(tp.reserved_name)}")
    if op.options != tp.options:
        diffs.append(f"{where}: options {op.options} != smg {tp.options}")


def _compare_field(where: str, o, t, op, tp, diffs: list[str]) -> None:
    """o/t: FieldDescriptors; op/tp: their FieldDescriptorProtos."""
    checks = {
        "number": (o.number, t.number),
        "type": (
            descriptor_pb2.FieldDescriptorProto.Type.Name(op.type),
            descriptor_pb2.FieldDescriptorProto.Type.Name(tp.type),
        ),
        "type_name": (_type_name(o), _type_name(t)),
        "label": (
            descriptor_pb2.FieldDescriptorProto.Label.Name(op.label),
            descriptor_pb2.FieldDescriptorProto.Label.Name(tp.label),
        ),
        "proto3_optional": (op.proto3_optional, tp.proto3_optional),
        "has_presence": (o.has_presence, t.has_presence),
        "oneof": (
            None if o.containing_oneof is None or op.proto3_optional else o.containing_oneof.name,
            None if t.containing_oneof is None or tp.proto3_optional else t.containing_oneof.name,
        ),
        "map": (_is_map(o), _is_map(t)),
        "json_name": (o.json_name, t.json_name),
        "options": (op.options.SerializeToString(), tp.options.SerializeToString()),
    }
    for what, (ov, tv) in checks.items():
        if ov != tv:
            diffs.append(f"{where}: {what} {ov!r} != smg {tv!r}")


def _compare_message(o, t, diffs: list[str]) -> None:
    where = f"message {o.full_name}"
    op = _as_proto(o, descriptor_pb2.DescriptorProto)
    tp = _as_proto(t, descriptor_pb2.DescriptorProto)

    of = {f.name: f for f in o.fields}
    tf = {f.name: f for f in t.fields}
    ofp = {f.name: f for f in op.field}
    tfp = {f.name: f for f in tp.field}
    for name in _names_diff(where, "field", of, tf, diffs):
        _compare_field(f"{o.full_name}.{name}", of[name], tf[name], ofp[name], tfp[name], diffs)

    # Real oneofs (proto3 `optional` fields get synthetic ones, compared via the field).
    def real_oneofs(desc, proto):
        optional = {f.name for f in proto.field if f.proto3_optional}
        return {
            od.name: sorted(f.name for f in od.fields)
            for od in desc.oneofs
            if not any(f.name in optional for f in od.fields)
        }

    oo, to = real_oneofs(o, op), real_oneofs(t, tp)
    for name in _names_diff(where, "oneof", oo, to, diffs):
        if oo[name] != to[name]:
            diffs.append(f"{where}: oneof {name} members {oo[name]} != smg {to[name]}")

    if _reserved(op.reserved_range) != _reserved(tp.reserved_range):
        diffs.append(f"{where}: reserved ranges {_reserved(op.reserved_range)} != smg {_reserved(tp.reserved_range)}")
    if sorted(op.reserved_name) != sorted(tp.reserved_name):
        diffs.append(f"{where}: reserved names {sorted(op.reserved_name)} != smg {sorted(tp.reserved_name)}")
    if op.options.SerializeToString() != tp.options.SerializeToString():
        diffs.append(f"{where}: options {op.options} != smg {tp.options}")
    if op.extension_range or tp.extension_range:
        diffs.append(f"{where}: extension ranges are unexpected in proto3")

    on = {m.name: m for m in o.nested_types}
    tn = {m.name: m for m in t.nested_types}
    for name in _names_diff(where, "nested message", on, tn, diffs):
        _compare_message(on[name], tn[name], diffs)

    oe = {e.name: e for e in o.enum_types}
    te = {e.name: e for e in t.enum_types}
    for name in _names_diff(where, "nested enum", oe, te, diffs):
        _compare_enum(oe[name], te[name], diffs)


def _compare_service(o, t, diffs: list[str]) -> None:
    where = f"service {o.full_name}"
    om = {m.name: m for m in o.methods}
    tm = {m.name: m for m in t.methods}
    for name in _names_diff(where, "rpc", om, tm, diffs):
        a, b = om[name], tm[name]
        for what, ov, tv in (
            ("input_type", a.input_type.full_name, b.input_type.full_name),
            ("output_type", a.output_type.full_name, b.output_type.full_name),
            ("client_streaming", a.client_streaming, b.client_streaming),
            ("server_streaming", a.server_streaming, b.server_streaming),
        ):
            if ov != tv:
                diffs.append(f"{where}.{name}: {what} {ov!r} != smg {tv!r}")


def compare_descriptor_sets(
    ours: descriptor_pb2.FileDescriptorSet, theirs: descriptor_pb2.FileDescriptorSet
) -> list[str]:
    """Every difference between what `ours` defines and the same symbols in `theirs`."""
    our_pool, their_pool = load_pool(ours), load_pool(theirs)
    diffs: list[str] = []
    for file_name in _own_files(ours):
        of = our_pool.FindFileByName(file_name)
        try:
            tf = their_pool.FindFileByName(file_name)
        except KeyError:
            diffs.append(f"file {file_name}: not in smg-grpc-proto")
            continue
        if of.package != tf.package:
            diffs.append(f"file {file_name}: package {of.package!r} != smg {tf.package!r}")
        ofp = _as_proto(of, descriptor_pb2.FileDescriptorProto)
        tfp = _as_proto(tf, descriptor_pb2.FileDescriptorProto)
        if ofp.syntax != tfp.syntax:
            diffs.append(f"file {file_name}: syntax {ofp.syntax!r} != smg {tfp.syntax!r}")

        if file_name in COMPLETE_FILES:
            for kind, o_names, t_names in (
                ("message", of.message_types_by_name, tf.message_types_by_name),
                ("enum", of.enum_types_by_name, tf.enum_types_by_name),
                ("service", of.services_by_name, tf.services_by_name),
            ):
                for name in sorted(set(t_names) - set(o_names)):
                    diffs.append(f"{kind} {tf.package}.{name}: defined by smg in {file_name} but not by us")

        for kind, ours_by_name, lookup, cmp in (
            ("message", of.message_types_by_name, their_pool.FindMessageTypeByName, _compare_message),
            ("enum", of.enum_types_by_name, their_pool.FindEnumTypeByName, _compare_enum),
            ("service", of.services_by_name, their_pool.FindServiceByName, _compare_service),
        ):
            for desc in ours_by_name.values():
                try:
                    theirs_desc = lookup(desc.full_name)
                except KeyError:
                    diffs.append(f"{kind} {desc.full_name}: defined by us but not by smg")
                    continue
                cmp(desc, theirs_desc, diffs)
    return diffs


def _reachable_types(service) -> set[str]:
    """Full names of every message and enum reachable from the service's rpcs."""
    seen: set[str] = set()
    stack = [m for method in service.methods for m in (method.input_type, method.output_type)]
    while stack:
        desc = stack.pop()
        if desc.full_name in seen:
            continue
        seen.add(desc.full_name)
        for field in getattr(desc, "fields", ()):
            if field.message_type is not None:
                stack.append(field.message_type)
            elif field.enum_type is not None:
                stack.append(field.enum_type)
    return seen


def _defined_types(fds: descriptor_pb2.FileDescriptorSet) -> set[str]:
    names: set[str] = set()

    def walk(prefix: str, messages, enums) -> None:
        for e in enums:
            names.add(f"{prefix}.{e.name}")
        for m in messages:
            names.add(f"{prefix}.{m.name}")
            walk(f"{prefix}.{m.name}", m.nested_type, m.enum_type)

    for f in fds.file:
        if not f.name.startswith(WELL_KNOWN_PREFIX):
            walk(f.package, f.message_type, f.enum_type)
    return names


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def descriptor_sets(tmp_path_factory):
    ours = build_descriptor_set(OUR_PROTO_DIR, tmp_path_factory.mktemp("ours"))
    theirs = build_descriptor_set(_smg_proto_dir(), tmp_path_factory.mktemp("smg"))
    return ours, theirs


def test_protos_match_smg_grpc_proto(descriptor_sets):
    ours, theirs = descriptor_sets
    assert sorted(_own_files(ours)) == sorted(PROTO_FILES)
    diffs = compare_descriptor_sets(ours, theirs)
    assert not diffs, f"{len(diffs)} difference(s) from smg-grpc-proto:\n  " + "\n  ".join(diffs)


def test_every_smg_rpc_and_reachable_type_is_ours(descriptor_sets):
    ours, theirs = descriptor_sets
    our_service = load_pool(ours).FindServiceByName(SERVICE)
    their_service = load_pool(theirs).FindServiceByName(SERVICE)

    missing_rpcs = sorted({m.name for m in their_service.methods} - {m.name for m in our_service.methods})
    assert not missing_rpcs, f"rpcs of smg's {SERVICE} missing from ours: {missing_rpcs}"

    reachable = {n for n in _reachable_types(their_service) if not n.startswith("google.protobuf.")}
    missing_types = sorted(reachable - _defined_types(ours))
    assert not missing_types, f"types reachable from {SERVICE} that we do not define: {missing_types}"
    # Sanity: the walk really went through common.proto's KV-event types.
    assert "smg.grpc.common.KvBlock" in reachable
    assert "smg.grpc.common.KvCacheTier" in reachable


def _find_message(fds, file_name: str, message: str) -> descriptor_pb2.DescriptorProto:
    f = next(f for f in fds.file if f.name == file_name)
    return next(m for m in f.message_type if m.name == message)


def test_checker_reports_differences(descriptor_sets):
    """The comparison is not vacuous: mutations of our descriptor set are all reported."""
    ours, theirs = descriptor_sets
    mutated = copy.deepcopy(ours)

    req = _find_message(mutated, "sglang_scheduler.proto", "GenerateRequest")
    next(f for f in req.field if f.name == "request_id").number = 99
    block = _find_message(mutated, "common.proto", "KvBlock")
    block.field.remove(next(f for f in block.field if f.name == "block_size"))
    svc = next(f for f in mutated.file if f.name == "sglang_scheduler.proto").service[0]
    next(m for m in svc.method if m.name == "Embed").server_streaming = True
    resp = _find_message(mutated, "sglang_scheduler.proto", "EmbedResponse")
    del resp.reserved_range[:]

    diffs = compare_descriptor_sets(mutated, theirs)
    report = "\n".join(diffs)
    assert "sglang.grpc.scheduler.GenerateRequest.request_id: number 99 != smg 1" in report, report
    assert "message smg.grpc.common.KvBlock: field 'block_size' is missing from ours" in report, report
    assert "SglangScheduler.Embed: server_streaming True != smg False" in report, report
    assert "message sglang.grpc.scheduler.EmbedResponse: reserved ranges [] != smg [(1, 4)]" in report, report
    assert len(diffs) == 4, report
