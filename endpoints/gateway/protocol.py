"""The protocol between the gateway's two halves, read from its one definition,
endpoints/gateway/dataplane/protocol.toml (the compiled data path's src/protocol.rs is written from the same
file: scripts/dataplane_protocol.py). What the TOML says each value is, it says once, there."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import tomllib
from pathlib import Path

SPEC = Path(__file__).resolve().parent / "dataplane" / "protocol.toml"
_RAW = SPEC.read_bytes()
_SPEC = tomllib.loads(_RAW.decode())

FINGERPRINT = hashlib.sha256(_RAW).hexdigest()
PREFIX = struct.Struct(_SPEC["frame_prefix"])  # length of what follows the length, request id, kind, head length
TAIL_BYTES: int = _SPEC["tail_bytes"]
EAGER_BODY: int = _SPEC["eager_body"]
STREAM_ERROR: bytes = _SPEC["stream_error"].encode() + b"\n\n"  # an SSE event ends with a blank line
FORWARDED_HEADERS = frozenset(h.encode() for h in _SPEC["forwarded_headers"])
ENGINE_HEADERS = frozenset(h.encode() for h in _SPEC["engine_headers"])
ARGUMENTS: tuple[str, ...] = tuple(_SPEC["arguments"])
_KINDS = {name: letter.encode() for side in _SPEC["kinds"].values() for name, (letter, _) in side.items()}
# Frame kinds: to the gateway
HELLO, REQUEST, BODY = _KINDS["hello"], _KINDS["request"], _KINDS["body"]
ANSWERED, UNREACHABLE, FAILED, CUT_SHORT, LEFT = (
    _KINDS["answered"],
    _KINDS["unreachable"],
    _KINDS["failed"],
    _KINDS["cut_short"],
    _KINDS["left"],
)
# and from it
ANSWER, SEND_BODY, FORWARD = _KINDS["answer"], _KINDS["send_body"], _KINDS["forward"]


def binary_refusal(binary: Path) -> str:
    """Why the data path at `binary` may not be started by this gateway, or "": it must speak this protocol
    (`binary --protocol` prints its fingerprint). A binary built before a `git pull` changed the protocol, or
    one from another checkout, is refused here, before it is given arguments it may not know."""
    try:
        done = subprocess.run(  # noqa: S603 (argv list, our own binary)
            [str(binary), "--protocol"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} could not be asked its protocol ({exc}): run `make dataplane`"
    theirs = done.stdout.strip()
    if done.returncode != 0 or theirs != FINGERPRINT:
        return (
            f"{binary} speaks another version of the gateway's protocol ({theirs[:12] or 'none'}, this gateway "
            f"{FINGERPRINT[:12]}): it was built from other sources; run `make dataplane` to rebuild it"
        )
    return ""
