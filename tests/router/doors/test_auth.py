"""TLS and bearer-token auth on the gRPC endpoint, end to end through pdserve's client SDK: the right token
passes, a wrong or missing one gets UNAUTHENTICATED (health probes need none), and a plaintext client to a
TLS server fails cleanly with UNAVAILABLE."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from inprocess_server import endpoint

from pdserve_client.sdk import PdserveClient, PdserveError

TOKEN = "s3cret-token"


def self_signed() -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def tls() -> tuple[bytes, bytes]:
    return self_signed()


@pytest.fixture(scope="module")
def secured(tls: tuple[bytes, bytes]) -> Iterator[str]:
    with endpoint(tls=tls, auth_token=TOKEN) as address:
        yield address


def generate(client: PdserveClient) -> list[int]:
    return client.generate_text(prompt="hello", max_tokens=2).token_ids


def test_the_right_token_over_tls_is_served(secured: str, tls: tuple[bytes, bytes]) -> None:
    with PdserveClient(secured, token=TOKEN, root_certificates=tls[1], timeout=60) as client:
        assert generate(client) == [5, 6]


@pytest.mark.parametrize("token", ["wrong-token", None], ids=["wrong", "missing"])
def test_a_wrong_or_missing_token_is_unauthenticated(
    secured: str, tls: tuple[bytes, bytes], token: str | None
) -> None:
    with PdserveClient(secured, token=token, root_certificates=tls[1], timeout=60) as client:
        with pytest.raises(PdserveError) as info:
            generate(client)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN not in info.value.message
        # Load balancers probe health without the secret.
        assert client.health() == "SERVING"


def test_a_plaintext_client_to_a_tls_server_fails_cleanly(secured: str) -> None:
    with PdserveClient(secured, token=TOKEN, timeout=10) as client, pytest.raises(PdserveError) as info:
        generate(client)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "Traceback" not in info.value.message


def test_a_client_that_does_not_trust_the_certificate_fails_cleanly(secured: str) -> None:
    _, other_cert = self_signed()
    client = PdserveClient(secured, token=TOKEN, root_certificates=other_cert, timeout=10)
    with client, pytest.raises(PdserveError) as info:
        generate(client)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
