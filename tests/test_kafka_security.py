"""Kafka TLS/SASL settings reach every client kvflow builds: aiokafka's
producer, consumer and admin client, and the router's Faust app.

The clients are built for real and never started; what each would connect
with is read back from the aiokafka client inside it.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess

import pytest
from faust.auth import SASLCredentials, SSLCredentials
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from kvflow.router.app import build_router_app
from kvflow.settings import Settings
from kvflow.streams import kafka
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import create_topics, make_consumer, make_producer
from kvflow.streams.kafka_security import client_security, faust_security

BOOTSTRAP = "broker.example:9093"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A throwaway self-signed certificate and key (PEM), serving as CA and client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=kvflow-test-ca"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def secure_settings(tls_files, protocol="SASL_SSL", **kw) -> Settings:
    cert, key = tls_files
    fields = dict(bootstrap_servers=BOOTSTRAP, kafka_security_protocol=protocol, kafka_sasl_mechanism="SCRAM-SHA-512",
                  kafka_sasl_plain_username="kvflow", kafka_sasl_plain_password="s3cret",
                  kafka_ssl_cafile=cert, kafka_ssl_certfile=cert, kafka_ssl_keyfile=key)
    fields.update(kw)
    return Settings(**fields)


def connection(client) -> dict:
    """What an aiokafka client would connect with."""
    return {"security_protocol": client._security_protocol, "ssl_context": client._ssl_context,
            "sasl_mechanism": client._sasl_mechanism, "sasl_plain_username": client._sasl_plain_username,
            "sasl_plain_password": client._sasl_plain_password}


def assert_trusts_test_ca(context: ssl.SSLContext) -> None:
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    subjects = [dict(x[0] for x in ca["subject"]) for ca in context.get_ca_certs()]
    assert {"commonName": "kvflow-test-ca"} in subjects


class _AdminStop(Exception):
    pass


def capture_admin(monkeypatch) -> list:
    """Make create_topics build its admin client for real, then stop before connecting."""
    built = []

    class Admin(kafka.AIOKafkaAdminClient):
        async def start(self):
            built.append(self)
            raise _AdminStop

    monkeypatch.setattr(kafka, "AIOKafkaAdminClient", Admin)
    return built


async def test_plaintext_default_changes_nothing(monkeypatch):
    settings = Settings(bootstrap_servers=BOOTSTRAP)
    assert settings.kafka_security_protocol == "PLAINTEXT"
    assert client_security(settings) == {} and faust_security(settings) == {}
    assert connection(make_producer(settings).client)["security_protocol"] == "PLAINTEXT"
    consumer = connection(make_consumer(settings)._client)
    assert consumer["security_protocol"] == "PLAINTEXT" and consumer["ssl_context"] is None
    admins = capture_admin(monkeypatch)
    with pytest.raises(_AdminStop):
        await create_topics(settings, Catalog("sec"))
    assert connection(admins[0]._client)["security_protocol"] == "PLAINTEXT"
    router = build_router_app(settings, Catalog("sec"))
    assert router.app.conf.broker_credentials is None


async def test_sasl_ssl_reaches_producer_consumer_admin_and_faust(tls_files, monkeypatch):
    settings = secure_settings(tls_files)
    expected = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_plain_username": "kvflow", "sasl_plain_password": "s3cret"}
    admins = capture_admin(monkeypatch)
    with pytest.raises(_AdminStop):
        await create_topics(settings, Catalog("sec"))
    clients = [make_producer(settings).client, make_consumer(settings, group_id="g")._client, admins[0]._client]
    for client in clients:
        got = connection(client)
        assert {k: got[k] for k in expected} == expected
        assert_trusts_test_ca(got["ssl_context"])

    router = build_router_app(settings, Catalog("sec"))
    creds = router.app.conf.broker_credentials
    assert isinstance(creds, SASLCredentials) and creds.username == "kvflow"
    # What faust-streaming hands its aiokafka producer and consumers:
    auth = credentials_to_aiokafka_auth(creds, router.app.conf.ssl_context)
    assert {k: auth[k] for k in expected} == expected
    assert_trusts_test_ca(auth["ssl_context"])


async def test_ssl_without_sasl(tls_files):
    settings = secure_settings(tls_files, protocol="SSL", kafka_sasl_plain_username=None,
                               kafka_sasl_plain_password=None)
    opts = client_security(settings)
    assert set(opts) == {"security_protocol", "ssl_context"} and opts["security_protocol"] == "SSL"
    got = connection(make_producer(settings).client)
    assert got["security_protocol"] == "SSL" and got["sasl_plain_username"] is None
    assert_trusts_test_ca(got["ssl_context"])
    creds = faust_security(settings)["broker_credentials"]
    assert isinstance(creds, SSLCredentials)
    assert credentials_to_aiokafka_auth(creds)["security_protocol"] == "SSL"


def test_sasl_plaintext_sends_no_tls_and_needs_credentials():
    settings = Settings(bootstrap_servers=BOOTSTRAP, kafka_security_protocol="SASL_PLAINTEXT",
                        kafka_sasl_plain_username="u", kafka_sasl_plain_password="p")
    assert client_security(settings) == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
                                         "sasl_plain_username": "u", "sasl_plain_password": "p"}
    creds = faust_security(settings)["broker_credentials"]
    assert credentials_to_aiokafka_auth(creds) == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
                                                   "sasl_plain_username": "u", "sasl_plain_password": "p",
                                                   "ssl_context": None}
    missing = Settings(bootstrap_servers=BOOTSTRAP, kafka_security_protocol="SASL_PLAINTEXT")
    with pytest.raises(ValueError, match="USERNAME"):
        client_security(missing)
    with pytest.raises(ValueError, match="PASSWORD"):
        make_producer(missing)


def test_security_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVFLOW_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KVFLOW_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("KVFLOW_KAFKA_SASL_PLAIN_USERNAME", "svc")
    monkeypatch.setenv("KVFLOW_KAFKA_SASL_PLAIN_PASSWORD", "hunter2")
    monkeypatch.setenv("KVFLOW_KAFKA_SSL_CAFILE", "/etc/kafka/ca.pem")
    settings = Settings()
    assert (settings.kafka_security_protocol, settings.kafka_sasl_mechanism, settings.kafka_sasl_plain_username,
            settings.kafka_ssl_cafile) == ("SASL_SSL", "SCRAM-SHA-256", "svc", "/etc/kafka/ca.pem")
    assert settings.kafka_sasl_plain_password.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(settings)
