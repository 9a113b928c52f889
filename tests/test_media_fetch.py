"""The safe media fetcher: what it fetches and what it refuses (with 400),
against a real HTTP server on the loopback interface."""

from __future__ import annotations

import asyncio
import base64

import pytest
from starlette.applications import Starlette
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from deployment import serve_app
from kvflow.streams.bridge.errors import BridgeError
from kvflow.streams.bridge.media_fetch import MediaPolicy, fetch_media, is_public_address

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # 1032 bytes; the fetcher never decodes it
LIMIT = 4096


async def ok(_):
    return Response(PNG, media_type="image/png")


async def big(_):
    return Response(b"x" * (LIMIT + 1), media_type="image/png")


async def big_chunked(_):
    async def body():
        for _ in range(8):
            yield b"x" * 1024

    return StreamingResponse(body(), media_type="image/png")  # no Content-Length


async def html(_):
    return Response("<html></html>", media_type="text/html")


async def slow(_):
    await asyncio.sleep(5)
    return Response(PNG, media_type="image/png")


def redirect(target: str):
    async def handler(_):
        return RedirectResponse(target, status_code=302)

    return handler


def app() -> Starlette:
    return Starlette(routes=[
        Route("/ok.png", ok), Route("/big.png", big), Route("/chunked.png", big_chunked), Route("/page", html),
        Route("/slow.png", slow), Route("/to-ok", redirect("/ok.png")),
        Route("/to-private", redirect("http://10.0.0.7/img.png")),
        Route("/to-metadata", redirect("http://169.254.169.254/latest/meta-data/")),
        Route("/to-other-loopback", redirect("http://127.0.0.2:9/img.png")),
        Route("/to-file", redirect("file:///etc/passwd")),
        Route("/loop", redirect("/loop")),
    ])


@pytest.fixture
async def server():
    async with serve_app(app()) as url:
        yield url


# Only the test server's own address is allow-listed, as an operator would an internal image store.
TRUSTED = MediaPolicy.of(allow_networks=("127.0.0.1/32",), max_bytes=LIMIT, timeout_s=2.0)


async def refused(url: str, policy: MediaPolicy) -> BridgeError:
    with pytest.raises(BridgeError) as info:
        await fetch_media(url, policy, param="messages.0.content.0.image_url.url")
    err = info.value
    assert err.status == 400 and err.code == "media_fetch_refused"
    assert err.param == "messages.0.content.0.image_url.url"
    return err


async def test_allowed_sources_are_fetched(server, tmp_path):
    got = await fetch_media(f"{server}/ok.png", TRUSTED)
    assert got.data == PNG and got.content_type == "image/png"
    assert (await fetch_media(f"{server}/to-ok", TRUSTED)).data == PNG
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert (await fetch_media(data_url, MediaPolicy())).data == PNG
    (tmp_path / "cat.png").write_bytes(PNG)
    local = MediaPolicy.of(allowed_roots=(tmp_path,))
    assert (await fetch_media(f"file://{tmp_path}/cat.png", local)).data == PNG


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/img.png", "http://localhost:9/img.png", "http://[::1]:9/img.png",
    "http://[::ffff:127.0.0.1]:9/img.png", "http://10.1.2.3/img.png", "http://192.168.0.10/img.png",
    "http://172.16.5.4/img.png", "http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/img.png",
    "http://0.0.0.0/img.png", "http://100.64.0.1/img.png",
])
async def test_private_loopback_and_link_local_addresses_are_refused(url):
    err = await refused(url, MediaPolicy())
    assert "private, loopback or link-local" in err.message


async def test_loopback_is_refused_unless_allow_listed(server):
    await refused(f"{server}/ok.png", MediaPolicy())
    assert (await fetch_media(f"{server}/ok.png", TRUSTED)).data == PNG


@pytest.mark.parametrize("path", ["/to-private", "/to-metadata", "/to-other-loopback", "/to-file"])
async def test_a_redirect_to_a_refused_target_is_refused(server, path):
    await refused(f"{server}{path}", TRUSTED)


async def test_size_type_time_and_redirect_limits(server):
    assert "larger than" in (await refused(f"{server}/big.png", TRUSTED)).message
    assert "larger than" in (await refused(f"{server}/chunked.png", TRUSTED)).message
    assert "text/html" in (await refused(f"{server}/page", TRUSTED)).message
    assert "not fetched within" in (await refused(f"{server}/slow.png", TRUSTED)).message
    assert "redirects more than" in (await refused(f"{server}/loop", TRUSTED)).message
    await refused(f"{server}/missing.png", TRUSTED)  # 404


async def test_local_files_only_under_allowed_roots(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    (root / "notes.txt").write_text("hi")
    (root / "huge.png").write_bytes(b"x" * (LIMIT + 1))
    policy = MediaPolicy.of(allowed_roots=(root,), max_bytes=LIMIT)
    assert (await fetch_media(f"file://{root}/ok.png", policy)).data == PNG
    await refused(f"file://{tmp_path}/secret.png", policy)  # outside the root
    await refused(f"file://{root}/../secret.png", policy)  # `..` out of it
    await refused(f"file://{root}/link.png", policy)  # a symlink out of it
    await refused("file:///etc/passwd", policy)
    await refused(f"file://{root}/notes.txt", policy)  # wrong type
    await refused(f"file://{root}/huge.png", policy)  # oversize
    await refused(f"file://{root}/ok.png", MediaPolicy())  # no roots: no local files


async def test_data_urls_and_schemes(tmp_path):
    small = MediaPolicy(max_bytes=LIMIT)
    await refused("data:text/plain;base64,aGVsbG8=", small)
    await refused("data:image/png;base64,@@@", small)
    await refused("data:image/png,rawbytes", small)
    await refused("data:image/png;base64," + base64.b64encode(b"x" * (LIMIT + 1)).decode(), small)
    await refused("ftp://example.com/img.png", small)
    await refused("gopher://127.0.0.1:70/", small)


def test_public_address_rule():
    import ipaddress

    assert is_public_address(ipaddress.ip_address("93.184.216.34"))
    assert is_public_address(ipaddress.ip_address("2606:2800:220:1:248:1893:25c8:1946"))
    for private in ("127.0.0.1", "10.0.0.1", "169.254.1.1", "::1", "fc00::1", "::ffff:10.0.0.1", "224.0.0.1"):
        assert not is_public_address(ipaddress.ip_address(private)), private


def test_policy_from_settings(monkeypatch, tmp_path):
    from kvflow.settings import Settings

    monkeypatch.setenv("KVFLOW_MEDIA_ALLOW_NETWORKS", "10.0.0.0/8, 127.0.0.1/32")
    monkeypatch.setenv("KVFLOW_MEDIA_ALLOWED_ROOTS", str(tmp_path))
    policy = MediaPolicy.from_settings(Settings(media_max_bytes=1234))
    assert [str(n) for n in policy.allow_networks] == ["10.0.0.0/8", "127.0.0.1/32"]
    assert policy.allowed_roots == (tmp_path.resolve(),) and policy.max_bytes == 1234
    monkeypatch.delenv("KVFLOW_MEDIA_ALLOW_NETWORKS")
    assert MediaPolicy.from_settings(Settings()).allow_networks == ()
