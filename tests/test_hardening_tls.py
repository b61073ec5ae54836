"""TLS and mTLS on the daemon's gRPC port (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs).

One daemon with mTLS for the module, reached by the real grpcurl, a Python gRPC client and the
real smg router, with certificates this module makes; start-up refusing a missing or bad file
before any model loads; and the rule that decides when binding an address earns a warning."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import SCHEDULER_SERVICE, SRC_DIR, Daemon, Router, find_executable, free_port, install_sigterm_cleanup
from servicer.tls import TLSConfigError, exposure_warning, is_loopback, load_server_credentials
from test_e2e_router import QUESTION

# ---------------------------------------------------------------- certificates


@dataclass
class Identity:
    cert: Path
    key: Path


@dataclass
class Pki:
    ca: Path  # the CA the daemon trusts for client certificates, and clients for the server's
    server: Identity  # for 127.0.0.1 and localhost
    client: Identity
    stranger: Identity  # a client certificate of another CA


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> None:
    path.touch(mode=0o600)  # as a private key should be (the router warns otherwise)
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _make_ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def _issue(directory: Path, name: str, ca, ca_key, usage, san: list[x509.GeneralName] | None = None) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )  # digitalSignature
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    identity = Identity(directory / f"{name}.pem", directory / f"{name}.key")
    identity.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, identity.key)
    return identity


def make_pki(directory: Path) -> Pki:
    ca, ca_key, ca_path = _make_ca(directory, "test-ca")
    other, other_key, _ = _make_ca(directory, "other-ca")
    loopback = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    return Pki(
        ca=ca_path,
        server=_issue(directory, "server", ca, ca_key, ExtendedKeyUsageOID.SERVER_AUTH, loopback),
        client=_issue(directory, "client", ca, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH),
        stranger=_issue(directory, "stranger", other, other_key, ExtendedKeyUsageOID.CLIENT_AUTH),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_credentials(pki: Pki, identity: Identity | None) -> grpc.ChannelCredentials:
    if identity is None:
        return grpc.ssl_channel_credentials(pki.ca.read_bytes())
    return grpc.ssl_channel_credentials(pki.ca.read_bytes(), identity.key.read_bytes(), identity.cert.read_bytes())


# ---------------------------------------------------------------- the mTLS daemon


class MtlsDaemon(Daemon):
    """The test daemon with --ssl-certfile/--ssl-keyfile/--ssl-ca-certs; its readiness polls
    go over mTLS with the client certificate."""

    def __init__(self, pki: Pki, **kwargs):
        tls = ["--ssl-certfile", str(pki.server.cert), "--ssl-keyfile", str(pki.server.key)]
        super().__init__(extra_args=tls + ["--ssl-ca-certs", str(pki.ca)], **kwargs)
        self.pki = pki

    def channel(self):
        return grpc.secure_channel(self.address, client_credentials(self.pki, self.pki.client))


@pytest.fixture(scope="module")
def tls_daemon(pki, tmp_path_factory):
    install_sigterm_cleanup()
    with MtlsDaemon(
        pki,
        model=os.environ.get("E2E_MODEL", "smollm2"),
        max_running_requests=4,
        kv_cache_tokens=4096,
        log_dir=tmp_path_factory.mktemp("tls-daemon"),
    ) as d:
        yield d


@pytest.fixture(scope="module")
def grpcurl(tls_daemon):
    exe = find_executable("grpcurl")

    def run(*args, tls: list[str], data=None) -> subprocess.CompletedProcess:
        cmd = [exe, "-max-time", "30", "-connect-timeout", "10", *tls]
        if data is not None:
            cmd += ["-d", json.dumps(data)]
        cmd += [tls_daemon.address, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    return run


def _mtls_flags(pki: Pki, identity: Identity) -> list[str]:
    return ["-cacert", str(pki.ca), "-cert", str(identity.cert), "-key", str(identity.key)]


def test_grpcurl_with_client_certificate_is_served(grpcurl, pki):
    listed = grpcurl("list", tls=_mtls_flags(pki, pki.client))
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert SCHEDULER_SERVICE in services and "grpc.health.v1.Health" in services, services
    health = grpcurl("grpc.health.v1.Health/Check", tls=_mtls_flags(pki, pki.client), data={"service": ""})
    assert health.returncode == 0, health.stderr
    assert json.loads(health.stdout)["status"] == "SERVING", health.stdout
    check = grpcurl(f"{SCHEDULER_SERVICE}/HealthCheck", tls=_mtls_flags(pki, pki.client), data={})
    assert check.returncode == 0 and json.loads(check.stdout).get("healthy") is True, (check.stdout, check.stderr)


@pytest.mark.parametrize(
    "client", ["no client certificate", "a client certificate of another CA", "plaintext"], ids=lambda c: c
)
def test_grpcurl_without_accepted_certificate_is_refused(grpcurl, pki, client):
    tls = {
        "no client certificate": ["-cacert", str(pki.ca)],
        "a client certificate of another CA": _mtls_flags(pki, pki.stranger),
        "plaintext": ["-plaintext"],
    }[client]
    out = grpcurl("grpc.health.v1.Health/Check", tls=tls, data={"service": ""})
    assert out.returncode != 0, f"served {client}: {out.stdout}"
    assert "SERVING" not in out.stdout


def test_python_client_with_certificate_gets_serving(tls_daemon, pki):
    with grpc.secure_channel(tls_daemon.address, client_credentials(pki, pki.client)) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=30
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_python_client_without_certificate_is_refused(tls_daemon, pki):
    with grpc.secure_channel(tls_daemon.address, client_credentials(pki, None)) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


# smg 1.13 builds its gRPC worker channels with no TLS configuration (grpc_client's
# connect_channel turns grpcs:// into https:// and connects): tonic refuses an https URI without
# one before any handshake, the worker never turns healthy and the router is never ready; its
# --ca-cert-paths/--client-cert-path/--client-key-path reach HTTP workers only. Strict, so that a
# router which dials grpcs:// workers with TLS turns this into a failure to remove the mark.
@pytest.mark.xfail(
    strict=True, raises=RuntimeError, reason="smg 1.13 dials grpcs:// workers without TLS (no TLS for gRPC workers)"
)
def test_router_over_mtls_routes_a_chat_completion(tls_daemon, pki, tmp_path_factory):
    mtls = ["--ca-cert-paths", str(pki.ca), "--client-cert-path", str(pki.client.cert)]
    mtls += ["--client-key-path", str(pki.client.key)]
    # (a short wait: the router retries a worker it could not reach only every 30 s)
    router = Router(tls_daemon.port, extra_args=mtls, log_dir=tmp_path_factory.mktemp("tls-router"), start_timeout_s=20)
    router.args[router.args.index(router.worker_url)] = router.worker_url = f"grpcs://{tls_daemon.address}"
    with router:
        body = {"model": router.model, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
        resp = router.post("/v1/chat/completions", body)
    assert resp.status == 200, resp
    assert "Paris" in resp.json()["choices"][0]["message"]["content"], resp


# ---------------------------------------------------------------- start-up checks


def test_missing_certificate_stops_start_up_naming_the_file(pki, tmp_path):
    missing = tmp_path / "no-such-cert.pem"
    cmd = [sys.executable, "-m", "servicer", "--host", "127.0.0.1", "--port", str(free_port())]
    cmd += ["--ssl-certfile", str(missing), "--ssl-keyfile", str(pki.server.key), "--ssl-ca-certs", str(pki.ca)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(SRC_DIR), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    assert str(missing) in out.stdout + out.stderr, out.stdout + out.stderr


def _files(cert=None, key=None, ca=None) -> tuple[str | None, str | None, str | None]:
    return cert and str(cert), key and str(key), ca and str(ca)


def test_credentials_of_good_files(pki):
    assert load_server_credentials(*_files()) is None  # plaintext
    assert isinstance(load_server_credentials(*_files(pki.server.cert, pki.server.key)), grpc.ServerCredentials)
    mtls = _files(pki.server.cert, pki.server.key, pki.ca)
    assert isinstance(load_server_credentials(*mtls), grpc.ServerCredentials)


def test_bad_files_are_named(pki, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cases = [
        (_files(cert=pki.server.cert), "--ssl-keyfile"),  # a certificate without its key
        (_files(key=pki.server.key), "--ssl-certfile"),
        (_files(ca=pki.ca), "--ssl-certfile"),
        (_files(garbage, pki.server.key), str(garbage)),
        (_files(pki.server.cert, pki.client.key), str(pki.client.key)),  # another certificate's key
        (_files(pki.server.cert, encrypted), str(encrypted)),
        (_files(pki.server.cert, pki.server.key, garbage), str(garbage)),
        (_files(pki.server.cert, pki.server.key, tmp_path / "no-ca.pem"), str(tmp_path / "no-ca.pem")),
    ]
    for config, named in cases:
        with pytest.raises(TLSConfigError) as refused:
            load_server_credentials(*config)
        assert named in str(refused.value), (config, refused.value)


# ---------------------------------------------------------------- the non-loopback warning


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LocalHost", "::ffff:127.0.0.1"]
)
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "10.1.2.3", "192.168.0.7", "fe80::1", "example.com"])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", tls=False, client_auth=False) is None
    assert exposure_warning("0.0.0.0", tls=True, client_auth=True) is None
    plaintext = exposure_warning("0.0.0.0", tls=False, client_auth=False)
    for word in ("0.0.0.0", "StartProfile", "FlushCache", "Abort", "--ssl-certfile", "--ssl-keyfile"):
        assert word in plaintext, plaintext
    server_only = exposure_warning("10.1.2.3", tls=True, client_auth=False)
    assert "--ssl-ca-certs" in server_only and "StartProfile" in server_only, server_only
