"""A safe fetcher for media a request names by URL (``image_url`` and the like).

A request body may name media as an ``http(s)://`` URL, a ``data:`` URL or
a ``file://`` path; fetching them on the caller's behalf must not let the
caller read what the bridge can reach and they cannot (server-side request
forgery). :func:`fetch_media` enforces a :class:`MediaPolicy`:

* **addresses**: the host is resolved first and every address it resolves
  to must be public: loopback, private (RFC 1918, unique-local), link-local
  (169.254.0.0/16 — cloud metadata services —, fe80::/10), multicast,
  reserved and unspecified addresses are refused, IPv4-mapped IPv6 ones by
  their IPv4 form, unless inside ``allow_networks``. The connection then
  goes to the checked address (the URL's host is kept for ``Host`` and
  TLS SNI/certificate checks), so a second DNS answer cannot swap it
  (DNS rebinding);
* **redirects** are followed by hand, at most ``max_redirects``, each
  target checked as above (http(s) only: never into ``file:`` or ``data:``);
* **local paths** (``file://``) only under ``allowed_roots``, after
  resolving symlinks and ``..``; none by default;
* **size**: at most ``max_bytes``, checked against ``Content-Length`` and
  counted while reading (a body without a length is cut at the limit);
* **time**: the whole fetch (resolution, redirects, body) within ``timeout_s``;
* **type**: the ``Content-Type`` (for files: guessed from the name; for
  ``data:`` URLs: their media type) must start with one of
  ``content_types``.

Every refusal is a :class:`~kvflow.streams.bridge.errors.BridgeError` with
status 400 and code ``media_fetch_refused`` (``param`` names the field
holding the URL), so a request naming such media is answered 400.
Environment proxies are not used (they would bypass the address checks).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import mimetypes
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from kvflow.settings import Settings
from kvflow.streams.bridge.errors import BridgeError

__all__ = ["MediaPolicy", "FetchedMedia", "fetch_media", "is_public_address", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
"""Largest media object fetched by default: 20 MiB, OpenAI's image input limit."""

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class MediaPolicy:
    """What :func:`fetch_media` may fetch.

    ``max_bytes``: largest object (bytes). ``timeout_s``: the whole fetch
    (seconds). ``content_types``: accepted media-type prefixes
    (``image/`` accepts every image type). ``allow_networks``: addresses
    fetched although not public (e.g. ``10.0.0.0/8`` for an internal image
    store). ``allowed_roots``: directories whose files ``file://`` URLs may
    name (none: no local files). ``max_redirects``: redirects followed.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = 10.0
    content_types: tuple[str, ...] = ("image/",)
    allow_networks: tuple[_Network, ...] = ()
    allowed_roots: tuple[Path, ...] = ()
    max_redirects: int = 3

    @classmethod
    def of(cls, *, allow_networks: tuple[str, ...] = (), allowed_roots: tuple[str | Path, ...] = (),
           **kw: object) -> "MediaPolicy":
        """A policy from CIDR strings and path strings (other fields as keywords).

        Raises:
            ValueError: a network is not valid CIDR.
        """
        return cls(allow_networks=tuple(ipaddress.ip_network(n, strict=False) for n in allow_networks),
                   allowed_roots=tuple(Path(r).resolve() for r in allowed_roots), **kw)  # type: ignore[arg-type]

    @classmethod
    def from_settings(cls, settings: Settings) -> "MediaPolicy":
        """The policy the settings configure (``media_*``, :class:`~kvflow.settings.Settings`).

        Raises:
            ValueError: ``media_allow_networks`` holds an invalid CIDR.
        """
        return cls.of(allow_networks=settings.media_allow_networks, allowed_roots=settings.media_allowed_roots,
                      max_bytes=settings.media_max_bytes, timeout_s=settings.media_fetch_timeout_s)


@dataclass(frozen=True)
class FetchedMedia:
    """Fetched bytes, their media type (without parameters) and where they came from."""

    data: bytes
    content_type: str
    source: str = field(default="")


def is_public_address(address: _Address) -> bool:
    """Whether ``address`` is a public unicast address (IPv4-mapped IPv6 judged by its IPv4 form)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not (address.is_private or address.is_loopback or address.is_link_local or address.is_multicast
                or address.is_reserved or address.is_unspecified or not address.is_global)


def _refused(message: str, param: str) -> BridgeError:
    return BridgeError(400, message, "invalid_request_error", code="media_fetch_refused", param=param)


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def _check_type(media_type: str, policy: MediaPolicy, param: str) -> None:
    if not any(media_type.startswith(prefix) for prefix in policy.content_types):
        raise _refused(f"media of type `{media_type or 'unknown'}` is not accepted "
                       f"(accepted: {', '.join(policy.content_types)})", param)


def _allowed(address: _Address, policy: MediaPolicy) -> bool:
    return is_public_address(address) or any(address in net for net in policy.allow_networks)


async def _resolve(host: str, port: int, policy: MediaPolicy, param: str) -> str:
    """The address to connect to for ``host``: every address it resolves to must be allowed.

    Raises:
        BridgeError: 400 when it does not resolve or an address is refused.
    """
    try:
        literal = ipaddress.ip_address(host)
        addresses = [literal]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise _refused(f"the media host `{host}` does not resolve", param) from None
        addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    refused = [a for a in addresses if not _allowed(a, policy)]
    if refused or not addresses:
        raise _refused(f"the media host `{host}` is a private, loopback or link-local address "
                       f"({refused[0] if refused else 'none'}); it is not fetched", param)
    return str(addresses[0])


def _data_url(url: str, policy: MediaPolicy, param: str) -> FetchedMedia:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise _refused("a data URL must be `data:<media type>;base64,<data>`", param)
    media_type = _media_type(header[: -len(";base64")])
    _check_type(media_type, policy, param)
    if len(payload) * 3 // 4 > policy.max_bytes + 2:
        raise _refused(f"the media is larger than {policy.max_bytes} bytes", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refused("the data URL is not valid base64", param) from None
    if len(data) > policy.max_bytes:
        raise _refused(f"the media is larger than {policy.max_bytes} bytes", param)
    return FetchedMedia(data, media_type, "data")


def _local_file(url: str, policy: MediaPolicy, param: str) -> FetchedMedia:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused("file URLs must name a local path", param)
    path = Path(unquote(parts.path)).resolve()  # symlinks and `..` resolved before the check
    if not any(path.is_relative_to(root) for root in policy.allowed_roots):
        raise _refused("the file is outside the directories media may be read from", param)
    _check_type(_media_type(mimetypes.guess_type(path.name)[0]), policy, param)
    try:
        if path.stat().st_size > policy.max_bytes:
            raise _refused(f"the media is larger than {policy.max_bytes} bytes", param)
        data = path.read_bytes()
    except OSError:
        raise _refused("the file cannot be read", param) from None
    if len(data) > policy.max_bytes:
        raise _refused(f"the media is larger than {policy.max_bytes} bytes", param)
    return FetchedMedia(data, _media_type(mimetypes.guess_type(path.name)[0]), str(path))


async def _read_body(response: httpx.Response, policy: MediaPolicy, param: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
        raise _refused(f"the media is larger than {policy.max_bytes} bytes", param)
    chunks, total = [], 0
    async for chunk in response.aiter_bytes():
        total += len(chunk)
        if total > policy.max_bytes:
            raise _refused(f"the media is larger than {policy.max_bytes} bytes", param)
        chunks.append(chunk)
    return b"".join(chunks)


async def _http(url: str, policy: MediaPolicy, param: str) -> FetchedMedia:
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise _refused("media may only be redirected to http(s) URLs", param)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = await _resolve(parts.hostname, port, policy, param)
            host = f"[{address}]" if ":" in address else address
            pinned = parts._replace(netloc=f"{host}:{port}").geturl()
            request = client.build_request("GET", pinned, headers={"Host": parts.netloc.rpartition("@")[2]},
                                           extensions={"sni_hostname": parts.hostname})
            response = await client.send(request, stream=True)
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise _refused("the media URL redirects nowhere", param)
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise _refused(f"fetching the media answered HTTP {response.status_code}", param)
                media_type = _media_type(response.headers.get("content-type"))
                _check_type(media_type, policy, param)
                return FetchedMedia(await _read_body(response, policy, param), media_type, url)
            finally:
                await response.aclose()
    raise _refused(f"the media URL redirects more than {policy.max_redirects} times", param)


async def fetch_media(url: str, policy: MediaPolicy, *, param: str = "url") -> FetchedMedia:
    """Fetch the media ``url`` names, as ``policy`` allows (see the module doc).

    ``param`` is the request field named in errors (e.g.
    ``messages.0.content.1.image_url.url``).

    Raises:
        BridgeError: 400 ``media_fetch_refused``: an unsupported scheme, a
            refused address or path, too large, of a refused type, not
            answered 200, too many redirects, or not done within
            ``policy.timeout_s``.
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, policy, param)
    if scheme == "file":
        return _local_file(url, policy, param)
    if scheme not in ("http", "https"):
        raise _refused(f"media URLs must be http(s), data or file URLs, not `{scheme or url[:16]}`", param)
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _http(url, policy, param)
    except TimeoutError:
        raise _refused(f"the media was not fetched within {policy.timeout_s:g} s", param) from None
    except httpx.HTTPError as exc:
        raise _refused(f"the media cannot be fetched: {type(exc).__name__}", param) from None
