"""TLS of the gRPC port, and the warning for a port open to the network without it (no gRPC
stubs imported here: tests load this beside smg-grpc-proto's)."""

from __future__ import annotations

import ipaddress
import ssl

import grpc


class TLSConfigError(Exception):
    """A TLS flag or file the daemon cannot serve with; the message names it."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: 127.0.0.0/8, ::1 or localhost."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # another host name: it may resolve to any interface
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def exposure_warning(host: str, tls: bool, client_auth: bool) -> str | None:
    """What start-up warns about binding ``host``: None where only this machine, or only
    clients with a certificate, can call the admin RPCs."""
    if is_loopback(host) or client_auth:
        return None
    if tls:
        return (
            f"listening on {host} with TLS but without --ssl-ca-certs: any client on the network can call "
            "the admin RPCs (StartProfile, FlushCache, Abort) as well as Generate; give --ssl-ca-certs to "
            "require client certificates, or keep the port behind a network policy"
        )
    return (
        f"listening on {host} in plaintext: anyone who can reach this port can call the admin RPCs "
        "(StartProfile, FlushCache, Abort) as well as Generate, and read every prompt and answer on the "
        "wire; use --ssl-certfile/--ssl-keyfile (and --ssl-ca-certs for client certificates), bind "
        "127.0.0.1, or keep the port behind a network policy"
    )


def _read_pem(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TLSConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def load_server_credentials(
    certfile: str | None, keyfile: str | None, ca_certs: str | None
) -> grpc.ServerCredentials | None:
    """The TLS credentials of --ssl-certfile, --ssl-keyfile and --ssl-ca-certs (None:
    plaintext), each file read and parsed now so that a bad one stops start-up with its name
    before the model loads. With ``ca_certs`` every client must present a certificate it signed."""
    if not (certfile or keyfile or ca_certs):
        return None
    if not certfile or not keyfile:
        raise TLSConfigError("--ssl-certfile and --ssl-keyfile go together (a certificate chain and its key)")
    chain, key = _read_pem("--ssl-certfile", certfile), _read_pem("--ssl-keyfile", keyfile)
    roots = _read_pem("--ssl-ca-certs", ca_certs) if ca_certs else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def no_password() -> bytes:  # gRPC takes no passphrase; and never prompt on a terminal
        raise TLSConfigError(f"--ssl-keyfile {keyfile}: an encrypted private key (gRPC needs it unencrypted)")

    try:
        context.load_verify_locations(cafile=certfile)
    except ssl.SSLError as e:
        raise TLSConfigError(f"--ssl-certfile {certfile}: no readable PEM certificate in it ({e})") from None
    try:
        context.load_cert_chain(certfile, keyfile, password=no_password)
    except ssl.SSLError as e:
        raise TLSConfigError(
            f"--ssl-keyfile {keyfile}: not the unencrypted PEM private key of --ssl-certfile {certfile} ({e})"
        ) from None
    if ca_certs:
        try:
            context.load_verify_locations(cafile=ca_certs)
        except ssl.SSLError as e:
            raise TLSConfigError(f"--ssl-ca-certs {ca_certs}: no readable PEM CA certificate in it ({e})") from None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=roots, require_client_auth=roots is not None)
