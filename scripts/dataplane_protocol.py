"""Write endpoints/gateway/dataplane/src/protocol.rs from the gateway's protocol definition
(endpoints/gateway/dataplane/protocol.toml): the compiled data path's constants, so its Python and Rust halves
read one definition. `make dataplane` runs it before cargo; `--check` exits 1 when the file on disk differs.

Written by hand (a few lines of formatting): no library turns TOML into Rust constants offline."""

from __future__ import annotations

import hashlib
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "endpoints" / "gateway" / "dataplane" / "protocol.toml"
OUT = ROOT / "endpoints" / "gateway" / "dataplane" / "src" / "protocol.rs"


def rust_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render() -> str:
    raw = SPEC.read_bytes()
    spec = tomllib.loads(raw.decode())
    lines = [
        "// Written by scripts/dataplane_protocol.py from ../protocol.toml (the one definition of the gateway's",
        "// protocol): do not edit; change the TOML and run `make dataplane`.",
        "#![allow(dead_code)]",
        "",
        f"pub const FINGERPRINT: &str = {rust_str(hashlib.sha256(raw).hexdigest())};",
        f"pub const TAIL_BYTES: usize = {spec['tail_bytes']};",
        f"pub const EAGER_BODY: u64 = {spec['eager_body']};",
    ]
    # An SSE event: the data line and the blank line that ends it.
    lines.append(f"pub const STREAM_ERROR: &[u8] = {rust_str(spec['stream_error'])[:-1]}\\n\\n\".as_bytes();")
    for name in ("forwarded_headers", "engine_headers", "arguments"):
        values = spec[name]
        lines.append(f"pub const {name.upper()}: [&str; {len(values)}] = [{', '.join(rust_str(v) for v in values)}];")
    for direction, kinds in spec["kinds"].items():
        lines.append(f"// {direction.replace('_', ' ')}")
        for name, (letter, meaning) in kinds.items():
            lines.append(f"pub const {name.upper()}: u8 = b'{letter}'; // {meaning}")
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.is_file() or OUT.read_text() != text:
            print(
                f"{OUT.relative_to(ROOT)} is not what {SPEC.relative_to(ROOT)} says: run scripts/dataplane_protocol.py"
            )
            return 1
        return 0
    if not OUT.is_file() or OUT.read_text() != text:
        OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
