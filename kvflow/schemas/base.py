"""The base every Kafka record shares, and the one wire serialization.

Serialization is JSON produced and parsed by pydantic's Rust core
(``model_dump_json`` / ``model_validate_json``). JSON rather than msgpack
because every topic can then be read with stock Kafka tools (kcat,
``kafka-console-consumer``), ClickHouse can ingest it directly, and pydantic
validates while it parses, so a record is either a valid model or a
:class:`RecordError` — there is no half-decoded state. Token ids make JSON
records about 2x larger than msgpack; at the record rates kvflow runs
(thousands/s) the broker is not the bottleneck, the model is.

One exception: a record class may define its own wire form with a
``to_wire()`` method and a ``from_wire(data)`` classmethod, which
:func:`encode` and :func:`decode` then use. Only
:class:`~kvflow.schemas.KvEventBatch` does (binary, see
:mod:`kvflow.schemas.kv_events`): every router replica folds every KV event
batch, and parsing its u64 block hashes from JSON cost more than using them.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

__all__ = ["Record", "RecordError", "encode", "decode", "now_ms"]

R = TypeVar("R")


class RecordError(ValueError):
    """A Kafka record's bytes did not validate against its topic's schema.

    Raised by :func:`decode`. Consumers catch it and forward the raw record to
    the dead-letter topic instead of dying.
    """


class Record(BaseModel):
    """Base of every topic record: frozen, versioned, unknown fields ignored.

    ``schema_version`` is bumped when a field changes meaning; readers accept
    older versions through ``upcast`` hooks on the subclass. Unknown fields are
    ignored so a newer producer can add optional fields without breaking older
    consumers.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    SCHEMA_VERSION: ClassVar[int] = 1
    schema_version: int = 1


def now_ms() -> int:
    """Wall-clock time in integer milliseconds since the Unix epoch."""
    return int(time.time() * 1000)


def encode(record: BaseModel) -> bytes:
    """Serialize a record to its wire form: UTF-8 JSON bytes, or the class's own ``to_wire()`` form.

    Raises:
        ValueError: the record does not fit its class's own wire form.
    """
    to_wire = getattr(type(record), "to_wire", None)
    if to_wire is not None:
        return to_wire(record)
    return record.model_dump_json(exclude_none=True).encode()


_adapters: dict[Any, TypeAdapter] = {}


def decode(schema: type[R] | Any, data: bytes | str | None) -> R:
    """Parse and validate wire bytes into ``schema``.

    ``schema`` is a model class or a (discriminated) union type. A class
    with its own wire form parses with its ``from_wire`` classmethod.

    Raises:
        RecordError: ``data`` is empty, not JSON (nor the class's own form), or fails validation.
    """
    if not data:
        raise RecordError("empty record value")
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            from_wire = getattr(schema, "from_wire", None)
            if from_wire is not None:
                return from_wire(data)
            return schema.model_validate_json(data)  # type: ignore[return-value]
        adapter = _adapters.get(schema)
        if adapter is None:
            adapter = _adapters[schema] = TypeAdapter(schema)
        return adapter.validate_json(data)
    except ValidationError as exc:
        raise RecordError(f"{exc.error_count()} validation error(s): {exc.errors(include_url=False)[:3]}") from exc
