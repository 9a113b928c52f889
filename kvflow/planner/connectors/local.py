"""The local connector: scale the worker processes of a ``kvflow up`` supervisor.

Scaling up starts worker processes; scaling down calls the supervisor, which
sends SIGTERM to the newest workers. A worker treats SIGTERM as *drain*
(:meth:`kvflow.workers.worker.Worker.drain`): it publishes a ``draining``
heartbeat so routers stop sending it work, keeps consuming its queue
partition for two heartbeat periods (requests routed before the routers saw
the heartbeat are still served), waits for its in-flight requests, publishes
``stopped`` and exits. No request is killed. :meth:`LocalConnector.apply`
returns once the drained processes have exited.
"""

from __future__ import annotations

from typing import Protocol

from kvflow.schemas import ScalingCommand, WorkerRole

__all__ = ["Scaler", "LocalConnector"]


class Scaler(Protocol):
    """What the local connector needs of a supervisor (:class:`kvflow.supervisor.Supervisor`)."""

    async def scale(self, role: WorkerRole, target: int) -> None:
        """Start or drain workers of ``role`` until ``target`` run."""
        ...

    def replicas(self, role: WorkerRole) -> int:
        """Worker processes of ``role`` running (not draining)."""
        ...


class LocalConnector:
    """Executes scaling commands on a local supervisor.

    Args:
        scaler: the supervisor.
        max_replicas: refuse targets above this (worker queue slots), or ``None``.
    """

    name = "local"

    def __init__(self, scaler: Scaler, max_replicas: int | None = None) -> None:
        self.scaler = scaler
        self.max_replicas = max_replicas

    async def apply(self, command: ScalingCommand) -> int:
        """Scale ``command.pool`` to ``command.target_replicas`` and wait until done.

        Returns:
            Worker processes of the pool running afterwards.

        Raises:
            ValueError: the target exceeds ``max_replicas``, or the command
                names a worker pool other than the default one (the supervisor
                starts default-pool workers only).
            RuntimeError: the supervisor ran out of queue slots.
        """
        if command.worker_pool:
            raise ValueError(f"the local connector runs the default worker pool only, not {command.worker_pool!r}")
        if self.max_replicas is not None and command.target_replicas > self.max_replicas:
            raise ValueError(f"target {command.target_replicas} > max_replicas {self.max_replicas}")
        await self.scaler.scale(command.pool, command.target_replicas)
        return self.scaler.replicas(command.pool)
