"""aiokafka clients configured for kvflow, topic creation, and dead-lettering.

Every kvflow process builds its Kafka clients here, so the embedded-broker
workarounds of :mod:`kvflow.streams.tansu_compat` and the connection
security of :mod:`kvflow.streams.kafka_security` apply in one place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from kvflow.schemas import DeadLetter, RecordError, decode, encode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams import doorbell
from kvflow.streams.fetch_wait import FetchWaitPolicy, install, woken
from kvflow.streams.kafka_security import client_security
from kvflow.streams.tansu_compat import consumer_overrides, producer_overrides

__all__ = ["make_producer", "make_consumer", "start_consumer", "create_topics", "DeadLetterWriter", "decode_record",
           "bootstrap", "fetch_wait_policy", "adapt_fetch_wait", "open_doorbell", "NOT_HOT", "FOLLOW_POLL_MS"]

log = logging.getLogger(__name__)
R = TypeVar("R")


def bootstrap(settings: Settings) -> str:
    """The bootstrap servers to use.

    Raises:
        ValueError: no ``bootstrap_servers`` was set (the embedded broker
            must be started first, e.g. by ``kvflow up``).
    """
    if not settings.bootstrap_servers:
        raise ValueError("no Kafka bootstrap servers: pass --bootstrap-servers or run `kvflow up`")
    return settings.bootstrap_servers


def make_producer(settings: Settings, **kwargs: Any) -> AIOKafkaProducer:
    """An un-started producer: ``settings.producer_linger_ms`` linger, no idempotence on the embedded broker,
    TLS/SASL as the settings say; ``kwargs`` override any of it."""
    opts: dict[str, Any] = {"bootstrap_servers": bootstrap(settings), "linger_ms": settings.producer_linger_ms, "client_id": "kvflow",
                            "max_request_size": settings.max_record_bytes}
    opts.update(client_security(settings))
    opts.update(producer_overrides(settings.embedded_broker))
    opts.update(kwargs)
    return AIOKafkaProducer(**opts)


def make_consumer(settings: Settings, *topics: str, group_id: str | None = None, **kwargs: Any) -> AIOKafkaConsumer:
    """An un-started consumer tuned for latency (short fetch wait on Tansu).

    With no ``topics`` the caller assigns partitions itself (``assign``).
    TLS/SASL as the settings say; ``kwargs`` override any of it.
    """
    opts: dict[str, Any] = {
        "bootstrap_servers": bootstrap(settings),
        "group_id": group_id,
        "enable_auto_commit": group_id is not None,
        "auto_offset_reset": "latest",
        "session_timeout_ms": settings.session_timeout_ms,
        "heartbeat_interval_ms": max(100, settings.session_timeout_ms // 3),  # Kafka: at most 1/3 of the session
        "client_id": "kvflow",
    }
    opts.update(client_security(settings))
    opts.update(consumer_overrides(settings.embedded_broker, settings.fetch_max_wait_ms))
    opts.update(kwargs)
    return AIOKafkaConsumer(*topics, **opts)


async def start_consumer(consumer: AIOKafkaConsumer) -> None:
    """Start ``consumer``; when starting fails or is cancelled, stop it, then re-raise.

    aiokafka leaves a consumer whose ``start()`` was interrupted (a group
    member cancelled while joining, say, when a router stops seconds after
    starting) with its client's metadata task and group coordinator
    running: it reconnects for ever to a broker that may be gone. Errors of
    the clean-up are suppressed so the original error is the one raised.
    """
    try:
        await consumer.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await consumer.stop()
        raise


def NOT_HOT(topic: str) -> bool:
    """Hot-topic predicate of background consumers: no record makes them poll fast."""
    return False


FOLLOW_POLL_MS = 30_000
"""``getmany`` timeout of a reader that follows a topic until cancelled: records
end the wait at once and a cancel interrupts it, so a short timeout would only
wake an idle process for nothing."""


RUNG_ACTIVE_WINDOW_S = doorbell.RING_GAP_S + 0.25
"""Active window of a consumer every writer rings (:attr:`FetchWaitPolicy.rung`),
seconds: a ring skipped because the partition was rung less than
:data:`~kvflow.streams.doorbell.RING_GAP_S` ago still finds the consumer
polling fast (0.25 s of margin: several ``fetch_max_wait_ms`` polls after the
record)."""


def fetch_wait_policy(settings: Settings, hot: Callable[[str], bool] | None = None,
                      idle_ms: int | None = None, busy: Callable[[], bool] | None = None,
                      rung: bool = False, idle_cap: Callable[[], int] | None = None) -> FetchWaitPolicy:
    """The adaptive fetch-wait policy the settings describe (see :mod:`kvflow.streams.fetch_wait`);
    ``idle_ms`` caps the quiet wait below ``settings.fetch_idle_wait_ms`` (``fetch_rung_idle_wait_ms``
    when ``rung``); ``idle_cap`` is called
    before each quiet fetch for a cap that varies (:attr:`FetchWaitPolicy.idle_cap`); ``busy`` says when
    the consumer must not park in a long poll (see :attr:`FetchWaitPolicy.busy`); ``rung``: every
    writer of its hot records rings it (:attr:`FetchWaitPolicy.rung`; its active window is then
    at most :data:`RUNG_ACTIVE_WINDOW_S`)."""
    longest = settings.fetch_rung_idle_wait_ms if rung else settings.fetch_idle_wait_ms
    idle = longest if idle_ms is None else min(idle_ms, longest)
    window = min(settings.fetch_active_window_s, RUNG_ACTIVE_WINDOW_S) if rung else settings.fetch_active_window_s
    return FetchWaitPolicy(active_ms=settings.fetch_max_wait_ms, idle_ms=idle,
                           catch_up_ms=settings.fetch_catch_up_wait_ms,
                           active_window_s=window, hot=hot, busy=busy, rung=rung, idle_cap=idle_cap)


def open_doorbell(settings: Settings) -> bool:
    """On the embedded broker, make this process's parked consumers wakeable by
    producers in other processes (:mod:`kvflow.streams.doorbell`); no-op on a
    real Kafka cluster or when the socket cannot be opened (logged: long polls
    then run out on their own, as without it). Call from the running loop.
    Returns whether this process is ringable."""
    if not settings.embedded_broker:
        return False
    try:
        doorbell.open_doorbell(bootstrap(settings), woken)
    except OSError as exc:
        log.warning("no doorbell for cross-process wake-ups (%s); idle consumers wait out their long polls", exc)
        return False
    return True


def adapt_fetch_wait(consumer: AIOKafkaConsumer, settings: Settings,
                     hot: Callable[[str], bool] | None = None, *, idle_ms: int | None = None,
                     busy: Callable[[], bool] | None = None, rung: bool = False,
                     idle_cap: Callable[[], int] | None = None) -> FetchWaitPolicy | None:
    """Give a started consumer of the embedded broker an adaptive fetch wait,
    and open this process's doorbell (:func:`open_doorbell`).

    ``hot``: topics whose records count as activity (None: all; :func:`NOT_HOT`
    for background consumers); ``idle_ms``: a lower cap on its quiet wait; ``idle_cap``: a cap
    that varies (:attr:`FetchWaitPolicy.idle_cap`);
    ``busy``: see :attr:`FetchWaitPolicy.busy`; ``rung``: see :attr:`FetchWaitPolicy.rung`
    (ignored when this process cannot open its doorbell).
    Returns the policy, or None on a real Kafka cluster, whose broker cuts
    long-polls short and needs none.
    """
    if not settings.embedded_broker:
        return None
    ringable = open_doorbell(settings)
    return install(consumer, fetch_wait_policy(settings, hot, idle_ms, busy, rung=rung and ringable,
                                               idle_cap=idle_cap))


async def create_topics(settings: Settings, catalog: Catalog) -> list[str]:
    """Create every catalog topic that does not exist yet; returns those created.

    Existing topics are left as they are (their partition counts must match
    the catalog; a mismatch is logged as an error). On a real cluster new
    topics get ``settings.topic_replication_factor`` replicas.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap(settings), client_id="kvflow-admin",
                                **client_security(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(t.name, t.partitions, 1 if settings.embedded_broker else settings.topic_replication_factor,
                     topic_configs={} if settings.embedded_broker else
                     {"cleanup.policy": t.cleanup_policy, "retention.ms": str(t.retention_ms),
                      "max.message.bytes": str(settings.max_record_bytes)})
            for t in catalog.all() if t.name not in existing
        ]
        if wanted:
            try:
                await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                pass
        return [t.name for t in wanted]
    finally:
        await admin.close()


def decode_record(schema: type[R] | Any, msg: ConsumerRecord) -> R:
    """Decode a consumed record's value with its topic schema.

    Raises:
        RecordError: the value is not a valid record.
    """
    return decode(schema, msg.value)


class DeadLetterWriter:
    """Sends records no consumer could process to the dead-letter topic.

    ``consumer`` names who gave up on the record. Never raises: failing to
    dead-letter is logged, since the consumer must keep going either way.
    """

    def __init__(self, producer: AIOKafkaProducer, catalog: Catalog, consumer: str) -> None:
        self.producer = producer
        self.topic = catalog.dead_letter.name
        self.consumer = consumer
        self.count = 0

    async def send(self, msg: ConsumerRecord, error: str | Exception) -> None:
        """Dead-letter ``msg`` with the reason ``error`` (original key and value
        bytes kept exactly, see :class:`~kvflow.schemas.DeadLetter`)."""
        self.count += 1
        record = DeadLetter.of(source_topic=msg.topic, partition=msg.partition, offset=msg.offset, key=msg.key,
                               value=msg.value, error=error, consumer=self.consumer)
        log.warning("dead-lettering %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, str(error)[:200])
        try:
            await self.producer.send_and_wait(self.topic, encode(record), key=msg.topic.encode())
        except Exception:  # noqa: BLE001 - a dead-letter failure must not kill the consumer
            log.exception("could not write dead letter for %s@%d", msg.topic, msg.offset)

    async def decode(self, schema: type[R] | Any, msg: ConsumerRecord) -> R | None:
        """Decode ``msg``; on :class:`RecordError` dead-letter it and return None."""
        try:
            return decode(schema, msg.value)
        except RecordError as exc:
            await self.send(msg, exc)
            return None
