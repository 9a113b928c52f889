"""Where a running ``kvflow up`` records itself, and how other commands find it.

Each deployment writes one state file, by default
``<data_dir>/deployments/<port>.json`` (``port``: its bridge port), or the
file named by ``KVFLOW_STATE_FILE``/``--state-file``. It holds what a
command joining the deployment needs: bootstrap servers, embedded-broker
flag, topic namespace, bridge URL, and the pid of the ``kvflow up`` process.
So two deployments on two ports keep two files, and ``kvflow status``,
``kvflow produce``, ``kvflow replay --mode online`` ... pick one with
``--port`` or ``--state-file`` (or take the only one running).

A file whose pid is no longer alive (the ``kvflow up`` was killed before it
could remove it) is stale: readers ignore and delete it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from kvflow.settings import Settings

__all__ = [
    "AmbiguousDeployment",
    "DeploymentNotFound",
    "DeploymentState",
    "deployments_dir",
    "find_deployment",
    "live_deployments",
    "pid_alive",
    "read_state",
    "remove_state",
    "state_path",
    "write_state",
]


class DeploymentState(BaseModel):
    """What ``kvflow up`` records about a running deployment."""

    bootstrap_servers: str
    embedded_broker: bool
    namespace: str
    url: str
    """The bridge's base URL (``http://host:port``), also when it serves no bridge."""
    port: int
    bridge: bool = True
    pid: int
    routing_policy: str | None = None
    data_dir: str | None = None
    metrics_url: str | None = None
    """The deployment's one Prometheus scrape point (every process's series), if served."""
    worker_metrics_urls: list[str] = []
    """Each worker's own ``/metrics`` as the workers started (scaling changes them; the scrape point follows)."""

    def describe(self) -> str:
        """One line for listings: port, URL, pid, namespace, broker."""
        return (f"port {self.port} ({self.url}{'' if self.bridge else ', no bridge'}), pid {self.pid}, "
                f"namespace {self.namespace}, kafka {self.bootstrap_servers}")


class DeploymentNotFound(LookupError):
    """No live deployment matches (none recorded, or only stale files)."""


class AmbiguousDeployment(LookupError):
    """Several live deployments are recorded and none was chosen."""


def deployments_dir(data_dir: str | Path) -> Path:
    """The directory of per-port state files under ``data_dir`` (absolute)."""
    return Path(data_dir).expanduser().absolute() / "deployments"


def state_path(settings: Settings, port: int) -> Path:
    """The state file of the deployment serving on ``port``: ``settings.state_file``
    if set, else ``<data_dir>/deployments/<port>.json``."""
    if settings.state_file:
        return Path(settings.state_file).expanduser()
    return deployments_dir(settings.data_dir) / f"{port}.json"


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists (possibly another user's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_state(path: Path, state: DeploymentState) -> None:
    """Write ``state`` to ``path`` atomically (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(state.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def read_state(path: Path, *, remove_stale: bool = True) -> DeploymentState | None:
    """The live deployment recorded in ``path``; ``None`` when the file is
    missing, unreadable, or stale (its pid is dead; then it is deleted unless
    ``remove_stale`` is false)."""
    try:
        state = DeploymentState.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError, ValidationError):
        return None
    if not pid_alive(state.pid):
        if remove_stale:
            with contextlib.suppress(OSError):
                path.unlink()
        return None
    return state


def remove_state(path: Path, pid: int | None = None) -> None:
    """Delete ``path`` if it records ``pid`` (default: this process), so a
    deployment never removes a file another one has since written."""
    pid = os.getpid() if pid is None else pid
    try:
        recorded = json.loads(path.read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return
    if recorded == pid:
        with contextlib.suppress(OSError):
            path.unlink()


def live_deployments(data_dir: str | Path) -> list[tuple[Path, DeploymentState]]:
    """Every live deployment recorded under ``data_dir``, by port; stale files are deleted."""
    found = []
    for path in sorted(deployments_dir(data_dir).glob("*.json")):
        state = read_state(path)
        if state is not None:
            found.append((path, state))
    return sorted(found, key=lambda item: item[1].port)


def find_deployment(settings: Settings, *, port: int | None = None,
                    state_file: str | Path | None = None) -> DeploymentState:
    """The running deployment a command should join.

    In order: the file ``state_file``; the deployment on ``port`` (its file
    under ``settings.data_dir``, or ``settings.state_file`` if that one
    records ``port``); ``settings.state_file`` (``KVFLOW_STATE_FILE``); the only
    live deployment under ``settings.data_dir``.

    Raises:
        DeploymentNotFound: nothing live matches.
        AmbiguousDeployment: several live deployments and neither ``port`` nor a state file chose one.
    """
    if state_file is not None:
        state = read_state(Path(state_file).expanduser())
        if state is None:
            raise DeploymentNotFound(f"no running deployment recorded in {state_file}")
        return state
    where = deployments_dir(settings.data_dir)
    if port is not None:
        state = read_state(where / f"{port}.json")
        if state is None and settings.state_file:
            state = read_state(Path(settings.state_file).expanduser())
            state = state if state is not None and state.port == port else None
        if state is None:
            raise DeploymentNotFound(f"no running deployment on port {port} recorded in {where}")
        return state
    if settings.state_file:
        state = read_state(Path(settings.state_file).expanduser())
        if state is None:
            raise DeploymentNotFound(f"no running deployment recorded in {settings.state_file} (KVFLOW_STATE_FILE)")
        return state
    live = live_deployments(settings.data_dir)
    if not live:
        raise DeploymentNotFound(f"no running deployment recorded in {where}")
    if len(live) > 1:
        listing = "\n".join(f"  {state.describe()}" for _, state in live)
        raise AmbiguousDeployment(f"{len(live)} deployments are running; choose one with --port:\n{listing}")
    return live[0][1]
