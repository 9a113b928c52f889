"""Open a ClickHouse client and create kvflow's metrics tables.

Two back ends behind one client type (``clickhouse_connect`` ``Client``):

* **embedded chDB** (default): ClickHouse running inside this Python process,
  storing its parts under a local directory. chDB hosts one engine path per
  process: while a client on directory A is open, opening directory B in the
  same process raises ``ProgrammingError``, and two processes must never share
  one directory. So exactly one process (the metrics sink / planner) owns the
  directory; everyone else reads through it.
* **a ClickHouse server** by URL (``http://user:pass@host:8123/db``), for
  production. Same SQL, same tables.

The DDL lives in ``infra/clickhouse/*.sql`` (canonical) and is shipped inside
the package as ``kvflow/data/clickhouse/*.sql`` (identical copies; a test
asserts it). :func:`ensure_schema` runs the packaged copy.

Never create a Kafka table engine through chDB: it cannot run one, and the
failed ``CREATE`` leaves a metadata file behind that breaks every later open of
the directory. :func:`ensure_schema` refuses such statements.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import clickhouse_connect
from clickhouse_connect.driver.client import Client

__all__ = ["open_client", "ensure_schema", "schema_files", "schema_statements", "SchemaError"]

_KAFKA_ENGINE = re.compile(r"ENGINE\s*=\s*Kafka\b", re.IGNORECASE)


class SchemaError(ValueError):
    """A DDL file holds a statement kvflow refuses to run (a Kafka table engine)."""


def open_client(url: str | None = None, data_dir: Path | str | None = None) -> Client:
    """Connect to ClickHouse and return a ``clickhouse_connect`` client.

    Args:
        url: ``http(s)://user:pass@host:port/database`` for a ClickHouse server,
            or a ``chdb://`` DSN (``chdb:///abs/dir``, ``chdb://memory``).
            ``None`` selects embedded chDB at ``data_dir``.
        data_dir: directory for embedded chDB (created if missing). Ignored when
            ``url`` is given. ``None`` with ``url=None`` gives an in-memory
            chDB whose data vanish when the process exits.

    Returns:
        An open client; call ``close()`` when done (an open chDB client pins
        its directory for the whole process).

    Raises:
        clickhouse_connect.driver.exceptions.ProgrammingError: another chDB
            directory is already open in this process.
        clickhouse_connect.driver.exceptions.OperationalError: the server at
            ``url`` cannot be reached.
    """
    if url:
        return clickhouse_connect.get_client(dsn=url)
    if data_dir is None:
        return clickhouse_connect.get_client(dsn="chdb://memory")
    path = Path(data_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return clickhouse_connect.get_client(dsn=f"chdb:///{path}")


def schema_files() -> list[Traversable]:
    """The packaged DDL files (``kvflow/data/clickhouse/*.sql``), in name order."""
    root = resources.files("kvflow").joinpath("data", "clickhouse")
    return sorted((f for f in root.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)


def schema_statements(sql: str) -> list[str]:
    """Split a DDL file into statements.

    Drops ``--`` comment lines and splits on ``;``. A ``;`` inside a string
    literal is not supported (the shipped DDL has none).

    Raises:
        SchemaError: a statement creates a Kafka table engine.
    """
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    statements = [s.strip() for s in "\n".join(lines).split(";")]
    statements = [s for s in statements if s]
    for stmt in statements:
        if _KAFKA_ENGINE.search(stmt):
            raise SchemaError("kvflow does not create Kafka table engines (chDB cannot run them); "
                              f"ingest through the metrics sink instead: {stmt[:80]!r}")
    return statements


def ensure_schema(client: Client) -> list[str]:
    """Create kvflow's metrics tables if they do not exist (idempotent).

    Every statement of every file is checked before any is run, so a bad file
    creates nothing.

    Returns:
        The statements executed, in order.

    Raises:
        SchemaError: a packaged file holds a Kafka table engine.
        clickhouse_connect.driver.exceptions.DatabaseError: ClickHouse rejected
            a statement.
    """
    statements = [s for f in schema_files() for s in schema_statements(f.read_text(encoding="utf-8"))]
    for stmt in statements:
        client.command(stmt)
    return statements
