"""KV transfer between workers: NIXL (UCX) with a TCP fallback, pulled by the reader.

The prefill side is the **source**: :meth:`KvTransport.expose` keeps a
contiguous buffer (host or GPU memory) alive and returns a
:class:`~kvflow.schemas.transfer.TransferDescriptor`, which travels on Kafka
inside the decode-stage record. The decode side **pulls**:
:meth:`KvTransport.pull` reads a byte range of that buffer into its own
buffer, then :meth:`KvTransport.release` tells the source it may free it.
The source also frees every buffer ``ttl_s`` after exposing it, so a decode
worker that died never leaks prefill memory.

Backends, chosen at run time by :meth:`KvTransport.start` and logged:

* **NIXL** (PyPI ``nixl``; UCX backend). The source registers the buffer
  with its agent and ships ``get_agent_metadata()`` (base64) plus the
  region's (address, length, device) in the descriptor. The reader loads the
  metadata (``add_remote_agent``), registers its destination, builds both
  descriptor lists (``get_xfer_descs``) and posts a ``READ``
  (``initialize_xfer`` + ``transfer``), polling ``check_xfer_state`` with a
  backoff capped at 250 us. Release is a NIXL notification
  (``send_notif``) that the source collects with ``get_new_notifs``. By
  default the agent runs without NIXL's progress thread, which busy-polls a
  core (see :attr:`TransferConfig.nixl_progress_thread`). A CUDA
  tensor is registered as ``VRAM`` (device id = its GPU index), so on GPU
  machines the bytes go GPU to GPU; kvflow's CI machine has no GPU, so that
  path has not run there. UCX reads GPU memory over ``cuda_ipc`` only where
  reads are enabled, which it does by default only between GPUs joined by
  NVLink; elsewhere NIXL's READ fell back to active messages over loopback
  TCP (0.6 GB/s on one H200). The agent is therefore created with
  :data:`UCX_ENV_DEFAULTS` (values already set in the environment win).
* **TCP**, always offered by a source (every descriptor carries
  ``tcp_host``/``tcp_port``), used when NIXL is missing, fails to
  initialise, or a NIXL read fails. A small framed protocol on asyncio
  sockets: the reader sends ``u32 length ‖ JSON header`` (``{"op": "read",
  "id", "offset", "nbytes"}`` or ``{"op": "release", "id"}``); the source
  answers ``u8 status ‖ u64 length ‖ payload`` (payload = the bytes, or an
  error message when status is 1). The loop's ``sock_sendall`` /
  ``sock_recv_into`` move bytes straight between the two buffers and the
  kernel, with no intermediate Python copies (asyncio stream transports in
  Python 3.11 copy unsent data into their own buffer).

Transfer ids carry a random suffix, so only a reader handed the descriptor
can name a buffer. All NIXL calls run on the event-loop thread (the agent is
created with thread sync ``NONE``), one remote agent at a time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvflow.schemas import now_ms
from kvflow.schemas.transfer import KvRegion, TransferDescriptor

UCX_ENV_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
"""UCX settings put in the environment (unless already set) before the NIXL agent
is created. ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``: UCX 1.23's ``cuda_ipc`` transport
offers one-sided reads (get zcopy) by default (``auto``) only when it detects
NVLink, because concurrent reads measured slower than writes over PCIe
(openucx/ucx issue 7566); NIXL pulls with READ, so without it UCX emulated the
reads over TCP. Measured with ``bench/kv_transfer.py --device cuda`` on one H200
without NVLink peers (docs/benchmarks.md, "GPU memory"): 256 MiB pulls 0.62 GB/s
with the default, ~210 GB/s with ``on``."""

__all__ = ["TransferError", "TransferConfig", "KvTransport", "buffer_info", "UCX_ENV_DEFAULTS"]

log = logging.getLogger(__name__)

_RELEASE_TAG = b"kvflow-release:"
_STATUS = struct.Struct("!BQ")  # status, payload length
_HEADER_LEN = struct.Struct("!I")
_MAX_HEADER = 64 * 1024
_SOCK_BUF = 8 * 2**20  # socket buffers: large enough to keep a loopback/LAN pipe full


class TransferError(RuntimeError):
    """A KV transfer could not be set up or completed (peer gone, buffer expired,
    NIXL error). The decode side reacts by prefilling the prompt itself."""


@dataclass(frozen=True)
class TransferConfig:
    """How a worker moves KV.

    Attributes:
        backend: ``auto`` (NIXL when it initialises, else TCP), ``nixl``
            (fail when NIXL cannot start) or ``tcp``. Defaults to ``auto``.
        host: address the TCP source listens on. Defaults to ``127.0.0.1``
            (single machine; multi-host deployments set a routable address
            or ``0.0.0.0``).
        advertise_host: address written in descriptors; None means ``host``,
            or this machine's resolved hostname when ``host`` is ``0.0.0.0``.
            Defaults to ``None``.
        ttl_s: seconds after which an unreleased exposed buffer is freed.
            Defaults to ``60``.
        nixl_progress_thread: run NIXL's UCX progress thread. It busy-polls
            one CPU core per process even when idle (measured: 2.6 s of CPU
            per 3 s idle); without it kvflow drives progress itself (the
            reader while it waits for a READ, the source every millisecond
            while it has buffers exposed). Worth turning on only where cores
            are plentiful and sources must progress at full speed (UCX
            transports without one-sided reads, e.g. TCP between hosts).
            Defaults to ``False``.

    Raises:
        ValueError: unknown backend or ``ttl_s`` <= 0.
    """

    backend: Literal["auto", "nixl", "tcp"] = "auto"
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    ttl_s: float = 60.0
    nixl_progress_thread: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nixl", "tcp"):
            raise ValueError(f"unknown KV transfer backend {self.backend!r}; use auto, nixl or tcp")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")

    @classmethod
    def from_settings(cls, settings: Any) -> TransferConfig:
        """Read ``kv_transfer_backend``, ``kv_transfer_host`` and ``kv_transfer_ttl_s``
        from :class:`~kvflow.settings.Settings` (class defaults for absent fields)."""
        return cls(
            backend=getattr(settings, "kv_transfer_backend", cls.backend),
            host=getattr(settings, "kv_transfer_host", cls.host),
            ttl_s=getattr(settings, "kv_transfer_ttl_s", cls.ttl_s),
            nixl_progress_thread=getattr(settings, "kv_transfer_nixl_progress_thread", cls.nixl_progress_thread),
        )


def buffer_info(buf: Any) -> tuple[int, int, str, int]:
    """``(address, num_bytes, mem_type, device_id)`` of a contiguous numpy array or torch tensor.

    ``mem_type`` is NIXL's ``DRAM`` (host) or ``VRAM`` (CUDA; ``device_id`` =
    GPU index).

    Raises:
        TransferError: the buffer is not contiguous or of an unknown type.
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TransferError("KV buffers must be contiguous")
        return buf.ctypes.data, buf.nbytes, "DRAM", 0
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):
        if not buf.is_contiguous():
            raise TransferError("KV buffers must be contiguous")
        nbytes = buf.numel() * buf.element_size()
        if buf.device.type == "cuda":
            return buf.data_ptr(), nbytes, "VRAM", buf.device.index or 0
        if buf.device.type != "cpu":
            raise TransferError(f"cannot transfer KV from device {buf.device}")
        return buf.data_ptr(), nbytes, "DRAM", 0
    raise TransferError(f"unsupported KV buffer type {type(buf).__name__}")


def _host_view(buf: Any) -> memoryview:
    """A writable byte view of a host buffer (numpy array or CPU tensor), no copy."""
    if isinstance(buf, np.ndarray):
        return memoryview(buf.reshape(-1).view(np.uint8))
    import torch

    return memoryview(buf.reshape(-1).view(torch.uint8).numpy())


# ----------------------------------------------------------------------------- TCP


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise TransferError("KV peer closed the connection mid-transfer")
        got += n


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await _recv_into(loop, sock, memoryview(buf))
    return bytes(buf)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass  # the kernel caps it; the default still works


async def _send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, header: dict) -> None:
    body = json.dumps(header).encode()
    await loop.sock_sendall(sock, _HEADER_LEN.pack(len(body)) + body)


async def _read_status(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> int:
    status, length = _STATUS.unpack(await _recv_exact(loop, sock, _STATUS.size))
    if status != 0:
        message = (await _recv_exact(loop, sock, length)).decode("utf-8", "replace")
        raise TransferError(f"KV source refused: {message}")
    return length


# ----------------------------------------------------------------------------- source state


@dataclass(eq=False)
class _Exposure:
    transfer_id: str
    buffer: Any
    num_bytes: int
    mem_type: str
    expires_at: float  # time.monotonic()
    nixl_reg: Any = None
    host_copy: memoryview | None = None
    reads: int = 0

    def host(self) -> memoryview:
        """Host bytes of the buffer (a GPU buffer is copied to host once, for TCP readers)."""
        if self.host_copy is None:
            buf = self.buffer.cpu() if self.mem_type == "VRAM" else self.buffer
            self.host_copy = _host_view(buf)
        return self.host_copy


@dataclass
class _Counters:
    exposed: int = 0
    released: int = 0
    expired: int = 0
    withdrawn: int = 0
    bytes_served_tcp: int = 0


class KvTransport:
    """One worker's KV transfer endpoint: source (expose/serve) and reader (pull/release).

    Lifecycle: ``await start()`` (picks the backend), any number of
    :meth:`expose` / :meth:`pull` / :meth:`release`, ``await close()``.
    :attr:`backend` is ``nixl`` or ``tcp`` after start.

    Args:
        name: a name unique among live workers (the NIXL agent name gets a
            random suffix, so a restarted worker never clashes with its ghost).
        config: backend choice, listen address, buffer TTL.
    """

    def __init__(self, name: str, config: TransferConfig | None = None) -> None:
        self.name = name
        self.config = config or TransferConfig()
        self.backend: Literal["nixl", "tcp"] = "tcp"
        self.nixl_error: str | None = None
        self.counters = _Counters()
        self._agent: Any = None
        self._agent_name = ""
        self._exposures: dict[str, _Exposure] = {}
        self._loaded_md: dict[str, bytes] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._server: socket.socket | None = None
        self._server_task: asyncio.Task | None = None
        self._conn_tasks: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._tcp_port = 0
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Initialise NIXL (per ``config.backend``) and the reaper task.

        Raises:
            TransferError: ``backend="nixl"`` and NIXL could not initialise.
        """
        if self._started:
            return
        if self.config.backend in ("auto", "nixl"):
            try:
                # Agent creation blocks for ~0.3 s (UCX context); keep the loop responsive.
                self._agent, self._agent_name = await asyncio.to_thread(self._make_agent)
                self.backend = "nixl"
            except Exception as exc:  # noqa: BLE001 - any NIXL failure means "use TCP"
                self.nixl_error = f"{type(exc).__name__}: {exc}"
                if self.config.backend == "nixl":
                    raise TransferError(f"NIXL could not initialise: {self.nixl_error}") from exc
        if self.backend == "nixl":
            log.info("KV transfer over NIXL (UCX), agent %s", self._agent_name)
        elif self.config.backend == "auto":
            log.warning("NIXL unavailable (%s); KV transfer over TCP", self.nixl_error)
        else:
            log.info("KV transfer over TCP (configured)")
        self._reaper = asyncio.create_task(self._reap_loop(), name=f"kv-transfer-reaper-{self.name}")
        self._started = True

    def _make_agent(self) -> tuple[Any, str]:
        for key, value in UCX_ENV_DEFAULTS.items():  # read when UCX's context is created, below
            os.environ.setdefault(key, value)
        from nixl._api import nixl_agent, nixl_agent_config

        agent_name = f"kvflow-{self.name}-{secrets.token_hex(4)}"
        config = nixl_agent_config(enable_prog_thread=self.config.nixl_progress_thread, backends=["UCX"])
        agent = nixl_agent(agent_name, config)
        if "UCX" not in agent.backends:
            raise RuntimeError("the NIXL UCX backend is not available")
        return agent, agent_name

    async def close(self) -> None:
        """Stop serving, free every exposed buffer, drop the NIXL agent."""
        for task in (self._reaper, self._server_task, *self._conn_tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._reaper, self._server_task, *self._conn_tasks) if t is not None),
                             return_exceptions=True)
        for transfer_id in list(self._exposures):
            self._free(transfer_id)
        if self._server is not None:
            self._server.close()
            self._server = None
        self._agent = None
        self._started = False

    @property
    def num_exposed(self) -> int:
        """Buffers exposed and not yet released or expired."""
        return len(self._exposures)

    # ------------------------------------------------------------------ source

    async def expose(self, transfer_id: str, buffer: Any, *, block_bytes: int = 0, num_blocks: int = 0,
                     num_tokens: int = 0, dtype: str = "", block_shape: tuple[int, ...] = ()) -> TransferDescriptor:
        """Keep ``buffer`` (contiguous numpy array or torch tensor, host or CUDA)
        readable until released or ``ttl_s`` passes; return its descriptor.

        ``transfer_id`` gets a random suffix. The layout arguments are copied
        into the descriptor for the reader (see
        :class:`~kvflow.schemas.transfer.TransferDescriptor`).

        Raises:
            TransferError: not started, or the buffer cannot be registered.
        """
        if not self._started:
            raise TransferError("KvTransport.start() was not called")
        address, nbytes, mem_type, device_id = buffer_info(buffer)
        await self._ensure_server()
        tid = f"{transfer_id}.{secrets.token_hex(8)}"
        exposure = _Exposure(tid, buffer, nbytes, mem_type, time.monotonic() + self.config.ttl_s)
        nixl_fields: dict[str, Any] = {}
        if self._agent is not None:
            try:
                exposure.nixl_reg = self._agent.register_memory([(address, nbytes, device_id, "")], mem_type)
                nixl_fields = dict(
                    nixl_agent=self._agent_name, nixl_mem_type=mem_type,
                    nixl_metadata_b64=base64.b64encode(self._agent.get_agent_metadata()).decode(),
                    regions=[KvRegion(address=address, num_bytes=nbytes, device_id=device_id)])
            except Exception as exc:  # noqa: BLE001 - the TCP path still serves this buffer
                log.warning("NIXL registration of %s failed (%s); offering TCP only", tid, exc)
        self._exposures[tid] = exposure
        self.counters.exposed += 1
        self._wake.set()
        host = self.config.advertise_host or self.config.host
        if host == "0.0.0.0":
            host = socket.gethostbyname(socket.gethostname())
        return TransferDescriptor(
            transfer_id=tid, source_worker_id=self.name, backend="nixl" if nixl_fields else "tcp",
            total_bytes=nbytes, block_bytes=block_bytes, num_blocks=num_blocks, num_tokens=num_tokens,
            dtype=dtype, block_shape=list(block_shape), tcp_host=host, tcp_port=self._tcp_port,
            expires_ms=now_ms() + int(self.config.ttl_s * 1000), **nixl_fields,
        )

    def withdraw(self, transfer_id: str) -> bool:
        """Free an exposed buffer before anyone pulled it (its request was
        cancelled); False when it is not exposed (released or expired)."""
        freed = self._free(transfer_id)
        self.counters.withdrawn += freed
        return freed

    def _free(self, transfer_id: str) -> bool:
        exposure = self._exposures.pop(transfer_id, None)
        if exposure is None:
            return False
        if exposure.nixl_reg is not None and self._agent is not None:
            try:
                self._agent.deregister_memory(exposure.nixl_reg)
            except Exception:  # noqa: BLE001 - freeing must not fail the worker
                log.warning("NIXL deregistration of %s failed", transfer_id, exc_info=True)
        return True

    async def _reap_loop(self) -> None:
        # Collect NIXL release notifications and expire old buffers, only
        # while something is exposed. Each notification poll also drives the
        # agent's progress engine, which UCX transports that emulate one-sided
        # reads need on the source side when there is no progress thread.
        interval = 0.01 if self.config.nixl_progress_thread or self._agent is None else 0.001
        while True:
            if not self._exposures:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(interval)
            if self._agent is not None:
                try:
                    notifs = self._agent.get_new_notifs()
                except Exception:  # noqa: BLE001
                    log.warning("NIXL notification poll failed", exc_info=True)
                    notifs = {}
                for messages in notifs.values():
                    for msg in messages:
                        if msg.startswith(_RELEASE_TAG) and self._free(msg[len(_RELEASE_TAG):].decode()):
                            self.counters.released += 1
            now = time.monotonic()
            for tid in [t for t, e in self._exposures.items() if e.expires_at <= now]:
                log.warning("KV buffer %s expired unreleased after %.0f s", tid, self.config.ttl_s)
                self._free(tid)
                self.counters.expired += 1

    async def _ensure_server(self) -> None:
        if self._server is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, 0))
        sock.listen(128)
        sock.setblocking(False)
        self._server, self._tcp_port = sock, sock.getsockname()[1]
        self._server_task = asyncio.create_task(self._accept_loop(sock), name=f"kv-tcp-{self.name}")
        log.info("KV TCP source of %s listening on %s:%d", self.name, self.config.host, self._tcp_port)

    async def _accept_loop(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(server)
            _tune(conn)
            task = asyncio.create_task(self._serve_conn(conn))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _serve_conn(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    (length,) = _HEADER_LEN.unpack(await _recv_exact(loop, conn, _HEADER_LEN.size))
                except TransferError:
                    return  # reader closed between frames
                if length > _MAX_HEADER:
                    return
                header = json.loads(await _recv_exact(loop, conn, length))
                await self._answer(loop, conn, header)
        except (OSError, TransferError, ValueError) as exc:
            log.debug("KV TCP connection ended: %s", exc)
        finally:
            conn.close()

    async def _answer(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, header: dict) -> None:
        tid = str(header.get("id", ""))
        if header.get("op") == "release":
            if self._free(tid):
                self.counters.released += 1
            await loop.sock_sendall(conn, _STATUS.pack(0, 0))
            return
        exposure = self._exposures.get(tid)
        offset, nbytes = int(header.get("offset", 0)), int(header.get("nbytes", 0))
        error = None
        if exposure is None:
            error = f"unknown or expired transfer {tid}"
        elif offset < 0 or nbytes < 0 or offset + nbytes > exposure.num_bytes:
            error = f"range [{offset}, {offset + nbytes}) outside the {exposure.num_bytes}-byte buffer"
        if error is not None:
            message = error.encode()
            await loop.sock_sendall(conn, _STATUS.pack(1, len(message)) + message)
            return
        view = exposure.host()[offset:offset + nbytes]
        await loop.sock_sendall(conn, _STATUS.pack(0, nbytes))
        await loop.sock_sendall(conn, view)
        exposure.reads += 1
        self.counters.bytes_served_tcp += nbytes

    # ------------------------------------------------------------------ reader

    async def pull(self, desc: TransferDescriptor, dest: Any, offset: int = 0) -> Literal["nixl", "tcp"]:
        """Read ``dest``'s size in bytes from byte ``offset`` of the source buffer into ``dest``.

        ``dest`` is a contiguous numpy array or torch tensor (host or CUDA).
        Uses NIXL when both sides have it, else (or when the NIXL read
        fails) TCP. Returns the backend that moved the bytes.

        Raises:
            TransferError: the range is outside the source buffer, or no
                backend could read it (source gone, buffer expired).
        """
        _, nbytes, _, _ = buffer_info(dest)
        if offset < 0 or offset + nbytes > desc.total_bytes:
            raise TransferError(f"range [{offset}, {offset + nbytes}) outside the {desc.total_bytes}-byte KV buffer")
        if nbytes == 0:
            return "nixl" if self._agent is not None and desc.nixl_agent else "tcp"
        if self._agent is not None and desc.nixl_agent and desc.regions:
            try:
                await self._nixl_read(desc, dest, offset)
                return "nixl"
            except Exception as exc:  # noqa: BLE001 - fall through to TCP
                if desc.tcp_port is None:
                    raise TransferError(f"NIXL read of {desc.transfer_id} failed: {exc}") from exc
                log.warning("NIXL read of %s failed (%s); retrying over TCP", desc.transfer_id, exc)
        await self._tcp_read(desc, dest, offset)
        return "tcp"

    async def _nixl_read(self, desc: TransferDescriptor, dest: Any, offset: int) -> None:
        agent = self._agent
        remote = desc.nixl_agent
        lock = self._peer_locks.setdefault(remote, asyncio.Lock())
        address, nbytes, mem_type, device_id = buffer_info(dest)
        region = desc.regions[0]
        async with lock:  # metadata reload and transfers to one peer never interleave
            metadata = base64.b64decode(desc.nixl_metadata_b64 or "")
            if self._loaded_md.get(remote) != metadata:
                agent.add_remote_agent(metadata)
                self._loaded_md[remote] = metadata
            reg = agent.register_memory([(address, nbytes, device_id, "")], mem_type)
            handle = None
            try:
                local_descs = agent.get_xfer_descs([(address, nbytes, device_id)], mem_type)
                remote_descs = agent.get_xfer_descs([(region.address + offset, nbytes, region.device_id)],
                                                    desc.nixl_mem_type)
                handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
                state = agent.transfer(handle)
                delay = 0.00002
                while state == "PROC":
                    # Each check also progresses the transfer (no progress thread by default);
                    # the backoff caps at 250 us so a fast pull is not stretched by polling.
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.00025)
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise TransferError(f"NIXL READ of {desc.transfer_id} ended in state {state}")
            finally:
                if handle is not None:
                    handle.release()
                agent.deregister_memory(reg)

    async def _tcp_read(self, desc: TransferDescriptor, dest: Any, offset: int) -> None:
        if desc.tcp_host is None or desc.tcp_port is None:
            raise TransferError(f"transfer {desc.transfer_id} offers no TCP endpoint")
        _, nbytes, mem_type, _ = buffer_info(dest)
        staging = dest
        if mem_type == "VRAM":  # TCP lands in host memory; copy up afterwards
            import torch

            staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await loop.sock_connect(sock, (desc.tcp_host, desc.tcp_port))
            await _send_frame(loop, sock, {"op": "read", "id": desc.transfer_id, "offset": offset, "nbytes": nbytes})
            length = await _read_status(loop, sock)
            if length != nbytes:
                raise TransferError(f"KV source sent {length} bytes, expected {nbytes}")
            await _recv_into(loop, sock, _host_view(staging))
        except OSError as exc:
            raise TransferError(f"TCP read of {desc.transfer_id} from {desc.tcp_host}:{desc.tcp_port} failed: "
                                f"{exc}") from exc
        finally:
            sock.close()
        if staging is not dest:
            dest.reshape(-1).view(staging.dtype).copy_(staging, non_blocking=False)

    async def release(self, desc: TransferDescriptor) -> None:
        """Tell the source it may free ``desc``'s buffer (best effort; the
        source's TTL frees it anyway). Never raises."""
        if self._agent is not None and desc.nixl_agent and desc.nixl_agent in self._loaded_md:
            try:
                self._agent.send_notif(desc.nixl_agent, _RELEASE_TAG + desc.transfer_id.encode())
                return
            except Exception as exc:  # noqa: BLE001
                log.debug("NIXL release of %s failed (%s); releasing over TCP", desc.transfer_id, exc)
        if desc.tcp_host is None or desc.tcp_port is None:
            return
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (desc.tcp_host, desc.tcp_port)), 5)
            await _send_frame(loop, sock, {"op": "release", "id": desc.transfer_id})
            await asyncio.wait_for(_read_status(loop, sock), 5)
        except (TimeoutError, OSError, TransferError) as exc:
            log.debug("TCP release of %s failed: %s", desc.transfer_id, exc)
        finally:
            sock.close()
