"""Kafka connection security (TLS, SASL) from :class:`~kvflow.settings.Settings`.

One mapping for every client kvflow builds: :func:`client_security` gives
the keyword arguments of aiokafka's producer, consumer and admin client;
:func:`faust_security` gives those of the router's ``faust.App``. With the
default ``PLAINTEXT`` both are empty, so nothing changes for the embedded
broker or an unsecured cluster.
"""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka.helpers import create_ssl_context

from kvflow.settings import Settings

__all__ = ["ssl_context", "client_security", "faust_security"]

_TLS = ("SSL", "SASL_SSL")
_SASL = ("SASL_PLAINTEXT", "SASL_SSL")


def ssl_context(settings: Settings) -> ssl.SSLContext:
    """A TLS context verifying the broker against ``kafka_ssl_cafile`` (the
    system CAs when unset), presenting ``kafka_ssl_certfile``/``kafka_ssl_keyfile``
    as the client certificate when set. Hostnames are checked.

    Raises:
        OSError, ssl.SSLError: a file is missing or not PEM.
    """
    return create_ssl_context(cafile=settings.kafka_ssl_cafile, certfile=settings.kafka_ssl_certfile,
                              keyfile=settings.kafka_ssl_keyfile)


def _sasl_credentials(settings: Settings) -> tuple[str, str]:
    username = settings.kafka_sasl_plain_username
    password = settings.kafka_sasl_plain_password
    if not username or password is None:
        raise ValueError(f"KVFLOW_KAFKA_SECURITY_PROTOCOL={settings.kafka_security_protocol} needs "
                         "KVFLOW_KAFKA_SASL_PLAIN_USERNAME and KVFLOW_KAFKA_SASL_PLAIN_PASSWORD")
    return username, password.get_secret_value()


def client_security(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``AIOKafkaProducer``/``AIOKafkaConsumer``/
    ``AIOKafkaAdminClient``: ``security_protocol``, an ``ssl_context`` for
    SSL/SASL_SSL, and ``sasl_mechanism``/``sasl_plain_username``/
    ``sasl_plain_password`` for SASL. Empty for ``PLAINTEXT``.

    Raises:
        ValueError: SASL without a username and password.
        OSError, ssl.SSLError: see :func:`ssl_context`.
    """
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    opts: dict[str, Any] = {"security_protocol": protocol}
    if protocol in _SASL:
        username, password = _sasl_credentials(settings)
        opts.update(sasl_mechanism=settings.kafka_sasl_mechanism, sasl_plain_username=username,
                    sasl_plain_password=password)
    if protocol in _TLS:
        opts["ssl_context"] = ssl_context(settings)
    return opts


def faust_security(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``faust.App``: ``broker_credentials``
    (``SSLCredentials`` or ``SASLCredentials``, which faust-streaming turns
    into the same aiokafka arguments as :func:`client_security`). Empty for
    ``PLAINTEXT``.

    Raises:
        ValueError, OSError, ssl.SSLError: see :func:`client_security`.
    """
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    import faust

    context = ssl_context(settings) if protocol in _TLS else None
    if protocol == "SSL":
        return {"broker_credentials": faust.SSLCredentials(context)}
    username, password = _sasl_credentials(settings)
    return {"broker_credentials": faust.SASLCredentials(username=username, password=password, ssl_context=context,
                                                        mechanism=settings.kafka_sasl_mechanism)}
