"""One definition of the protocol between the gateway's two halves (endpoints/gateway/dataplane/protocol.toml):
the compiled data path's constants are written from it, neither half spells a frame kind or a shared constant of
its own, and a data path built from another version is refused with a message, before it starts (`--protocol`)
and at its first frame (the hello), instead of failing on an argument it does not know or misreading frames."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from endpoints.gateway import dataplane, protocol
from endpoints.gateway.dataplane import PREFIX, Control

ROOT = Path(__file__).resolve().parents[2]
MAIN_RS = ROOT / "endpoints" / "gateway" / "dataplane" / "src" / "main.rs"


def test_the_data_paths_constants_are_written_from_the_one_definition():
    checked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dataplane_protocol.py"), "--check"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout
    rust = MAIN_RS.read_text()
    # No frame kind spelled as a letter, no shared constant defined again beside the generated module.
    assert not re.findall(r"b'[A-Z]'", rust)
    for name in ("TAIL_BYTES", "EAGER_BODY", "STREAM_ERROR", "FORWARDED_HEADERS", "ENGINE_HEADERS"):
        assert not re.search(rf"\bconst {name}\b", rust), name
    python = (ROOT / "endpoints" / "gateway" / "dataplane.py").read_text()
    assert not re.findall(r'\bb"[A-Z]"', python) and "struct.Struct" not in python


def test_both_halves_agree_on_the_data_paths_arguments():
    rust = set(re.findall(r'argument\(&args, "(--[a-z-]+)"\)', MAIN_RS.read_text()))
    rust |= set(re.findall(r'seconds\("(--[a-z-]+)"\)', MAIN_RS.read_text()))
    serve = (ROOT / "endpoints" / "gateway" / "dataplane.py").read_text().split("async def serve", 1)[1]
    python = set(re.findall(r'"(--[a-z-]+)"', serve.split("env=child_environment", 1)[0]))
    assert rust == python == set(protocol.ARGUMENTS)


def test_the_built_data_path_speaks_this_protocol():
    binary = dataplane.binary()
    if not binary.is_file():
        pytest.skip(f"{binary} is not built (make dataplane)")
    assert protocol.binary_refusal(binary) == ""


@pytest.fixture
def stale_binary(tmp_path):
    """A data path built from another version of the protocol: it answers --protocol with another fingerprint."""
    stale = tmp_path / "llm-console-dataplane"
    stale.write_text("#!/bin/sh\necho 0123456789abcdef-another-protocol\n")
    stale.chmod(0o755)
    return stale


def test_a_stale_binary_is_refused_before_it_starts(stale_binary):
    refusal = protocol.binary_refusal(stale_binary)
    assert "another version of the gateway's protocol" in refusal and "make dataplane" in refusal
    with override_settings(GATEWAY_DATAPLANE="rust", GATEWAY_DATAPLANE_BINARY=str(stale_binary)):
        with pytest.raises(CommandError, match="another version of the gateway's protocol"):
            call_command("gateway", "--port", "1")
    with override_settings(GATEWAY_DATAPLANE="auto", GATEWAY_DATAPLANE_BINARY=str(stale_binary)):
        assert dataplane.chosen() == "python"  # auto serves with the Python data path, and says why (below)


@pytest.mark.parametrize(
    "first, greeted",
    [
        ((protocol.HELLO, protocol.FINGERPRINT.encode()), True),
        ((protocol.HELLO, b"0123456789abcdef"), False),  # another version's hello
        ((protocol.REQUEST, b"GET\n/healthz\n\n\n1"), False),  # a data path from before the handshake
    ],
)
def test_the_first_frame_must_be_this_protocols_hello(first, greeted):
    from endpoints.gateway.asgi import Gateway

    async def scenario():
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        _, control = await loop.create_unix_connection(lambda: Control(Gateway(), lost), sock=ours)
        kind, head = first
        theirs.sendall(PREFIX.pack(13 + len(head), 0, kind[0], len(head)) + head)
        for _ in range(100):  # until the frame was read (greeted) or the mismatch stopped the gateway (lost)
            if control.greeted or lost.done():
                break
            await asyncio.sleep(0.02)
        seen = control.greeted, lost.done()  # before the socket closes (its end would end the gateway too)
        theirs.close()
        return seen

    was_greeted, stopped = asyncio.run(scenario())
    assert was_greeted is greeted
    assert stopped is not greeted  # a mismatch stops the gateway (its supervisor restarts it, and the log says why)
