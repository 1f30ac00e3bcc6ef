"""A local S3 server for the tests (moto's, in a thread), served over HTTPS with a certificate of a test
authority: litdata fetches chunks through obstore, whose client refuses an ``http://`` endpoint and is not
told to allow one; over HTTPS it trusts the authority that ``SSL_CERT_FILE`` names, and boto3 (litdata's
index reads) the one ``AWS_CA_BUNDLE`` names."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import threading
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from werkzeug.serving import make_server

__all__ = ["https_s3_server"]


def _certificate(subject: str, issuer: str, key, signer, *, authority: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
    )
    if not authority:  # the server's own: for localhost and 127.0.0.1
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


@contextlib.contextmanager
def https_s3_server(folder: Path) -> Iterator[tuple[str, Path]]:
    """moto's S3 server on a free port of localhost, over HTTPS: yields its endpoint URL and the PEM file of
    the authority that signed its certificate (written to ``folder``)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )

    authority_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    authority = _certificate("test authority", "test authority", authority_key, authority_key, authority=True)
    server = _certificate("localhost", "test authority", server_key, authority_key, authority=False)
    pem = serialization.Encoding.PEM
    (folder / "authority.pem").write_bytes(authority.public_bytes(pem))
    (folder / "server.pem").write_bytes(server.public_bytes(pem))
    (folder / "server.key").write_bytes(
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    app = DomainDispatcherApplication(create_backend_app)
    served = make_server(
        "127.0.0.1",
        0,
        app,
        threaded=True,
        request_handler=MotoRequestHandler,
        ssl_context=(str(folder / "server.pem"), str(folder / "server.key")),
    )
    thread = threading.Thread(target=served.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://localhost:{served.server_address[1]}", folder / "authority.pem"
    finally:
        served.shutdown()
        thread.join()
