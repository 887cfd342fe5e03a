"""Header rows of npu-smi's tables: column names located by position, never by fixed offsets."""

from __future__ import annotations

import re

# --------------------------------------------------------------------------- headers


def _norm(name: str) -> str:
    """Header name -> comparison key: 'Bus-Id' -> 'busid', 'NPU Util(%)' -> 'npuutil(%)'."""
    return re.sub(r"[\s_\-]+", "", name.lower())


# Default-table columns (normalised header name -> internal field).
_DEVICE_COLUMNS = {
    "npu": "npu",
    "npuid": "npu",
    "npuidx": "npu",
    "chip": "chip",
    "chipid": "chip",
    "chipidx": "chip",
    "device": "device_id",
    "deviceid": "device_id",
    "phyid": "device_id",
    "phy": "device_id",
    "name": "name",
    "chipname": "name",
    "health": "health",
    "power(w)": "power_w",
    "power": "power_w",
    "pwr(w)": "power_w",
    "temp(c)": "temp_c",
    "temp": "temp_c",
    "temperature(c)": "temp_c",
    "temperature": "temp_c",
    "aicore(%)": "aicore_pct",
    "aicore": "aicore_pct",
    "npuutil(%)": "aicore_pct",
    "npuutil": "aicore_pct",
    "aicoreutil(%)": "aicore_pct",
    "hugepagesusage(page)": "hugepages",
    "hugepagesusage": "hugepages",
    "hugepages(page)": "hugepages",
    "hugepages": "hugepages",
    "memoryusage(mb)": "memory",
    "memoryusage": "memory",
    "memory(mb)": "memory",
    "hbmusage(mb)": "hbm",
    "hbmusage": "hbm",
    "hbm(mb)": "hbm",
    "busid": "bus_id",
    "bus": "bus_id",
    "pcibusid": "bus_id",
}
# Process-table columns.
_PROCESS_COLUMNS = {
    "npu": "npu",
    "npuid": "npu",
    "chip": "chip",
    "chipid": "chip",
    "processid": "pid",
    "pid": "pid",
    "processname": "name",
    "processmemory(mb)": "memory_mb",
    "processmemory": "memory_mb",
    "processidincontainer": "container_pid",
}
_KNOWN_NAMES = set(_DEVICE_COLUMNS) | set(_PROCESS_COLUMNS)
# Multi-word header names, longest first, used to split single-spaced headers.
_KNOWN_PHRASES = sorted(
    {
        "NPU ID",
        "Chip ID",
        "Chip Name",
        "NPU Util(%)",
        "AICore Util(%)",
        "Process id in container",
        "Process id",
        "Process name",
        "Process memory(MB)",
        "Process memory",
        "PCI Bus-Id",
    },
    key=lambda p: -len(p.split()),
)
_KNOWN_PHRASE_NORMS = {(_norm(p), len(p.split())) for p in _KNOWN_PHRASES}
_PHRASE_MAX_WORDS = max(len(p.split()) for p in _KNOWN_PHRASES)

_WORD_RE = re.compile(r"\S+")
_CHUNK_RE = re.compile(r"\S+(?: \S+)*")  # runs separated by 2+ spaces
# A value token: an "N / M" pair (kept as ONE token, also '26838/ 32768') or any word.
_VALUE_TOKEN_RE = re.compile(r"(?<!\S)(?:\d+(?:\.\d+)?|NA|-)\s*/\s*(?:\d+(?:\.\d+)?|NA|-)(?!\S)|\S+")
_NUMERIC_TOKEN_RE = re.compile(r"[+-]?\d+(?:\.\d+)?(?:\s*/\s*\S+)?")


def _split_header_block(block: str) -> list[tuple[str, int]]:
    """Split one ``|`` block of a header row into (column name, offset) pairs.

    Columns are separated by 2+ spaces; within a single-spaced run, known
    names (``NPU ID``, ``Process id``...) are matched greedily, a word that
    ends in ``)`` or contains ``-`` closes a name (``Power(W) Temp(C)``), and
    other words are joined (``Process id in container``-style names).
    """
    names: list[tuple[str, int]] = []
    for chunk in _CHUNK_RE.finditer(block):
        words = [(m.group(), chunk.start() + m.start()) for m in _WORD_RE.finditer(chunk.group())]
        cur: list[tuple[str, int]] = []

        def flush(cur: list[tuple[str, int]] = cur) -> None:
            if cur:
                names.append((" ".join(w for w, _ in cur), cur[0][1]))
                cur.clear()

        i = 0
        while i < len(words):
            matched = 0
            for n in range(min(_PHRASE_MAX_WORDS, len(words) - i), 1, -1):
                phrase = _norm(" ".join(w for w, _ in words[i : i + n]))
                if (phrase, n) in _KNOWN_PHRASE_NORMS:
                    matched = n
                    break
            if matched:
                flush()
                names.append((" ".join(w for w, _ in words[i : i + matched]), words[i][1]))
                i += matched
                continue
            word, off = words[i]
            if _norm(word) in _KNOWN_NAMES:
                flush()
                names.append((word, off))
            else:
                cur.append((word, off))
                if word.endswith(")") or "-" in word:
                    flush()
            i += 1
        flush()
    return names


def _split_row(line: str) -> list[str] | None:
    """'| a | b |' -> [' a ', ' b ']; None for lines that are not table rows."""
    s = line.strip()
    if not s.startswith("|"):
        return None
    inner = s[1:]
    if inner.endswith("|"):
        inner = inner[:-1]
    return inner.split("|")


class _Header:
    """One header row: per block, the list of (name, offset)."""

    def __init__(self, blocks: list[str]):
        self.blocks = [_split_header_block(b) for b in blocks]

    def names(self) -> list[str]:
        return [n for block in self.blocks for n, _ in block]

    def values(self, blocks: list[str], columns: dict[str, str]) -> dict[str, str]:
        """Match a data row's blocks to this header; returns {field: raw text}."""
        out: dict[str, str] = {}
        for idx, header in enumerate(self.blocks):
            if not header or idx >= len(blocks):
                continue
            raw = blocks[idx]
            if len(header) == 1:
                pieces = [raw.strip()]
            else:
                pieces = _assign_tokens(header, raw)
            for (name, _), value in zip(header, pieces, strict=False):
                field = columns.get(_norm(name))
                if field and value is not None and value != "" and field not in out:
                    out[field] = value
        return out


def _assign_tokens(header: list[tuple[str, int]], raw: str) -> list[str | None]:
    """Split a value block into one string per header column.

    Tokens are zipped with the column names when the counts agree; otherwise
    each token goes to the column whose header starts nearest to it (so an
    empty cell or a value containing spaces still lands in the right column).
    """
    tokens = [(m.group(), m.start()) for m in _VALUE_TOKEN_RE.finditer(raw)]
    if len(tokens) == len(header):
        return [t for t, _ in tokens]
    result: list[list[str]] = [[] for _ in header]
    for tok, off in tokens:
        best = min(range(len(header)), key=lambda i: (abs(header[i][1] - off), i))
        result[best].append(tok)
    return [" ".join(parts) if parts else None for parts in result]


def _is_header_row(blocks: list[str]) -> bool:
    names = [n for b in blocks for n, _ in _split_header_block(b)]
    if not any(_norm(n) in _KNOWN_NAMES for n in names):
        return False
    # Data rows always carry some number (ids, usage); header rows never do.
    return not any(_NUMERIC_TOKEN_RE.fullmatch(t) for b in blocks for t in b.split())
