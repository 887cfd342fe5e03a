"""Benchmark workloads: which endpoint, what load, which prompts; checked before anything is queued."""
import hashlib
import json
import math
import os
import re
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

from endpoints.models import Endpoint

DEDUPE = "bench:endpoint:{}"
VIA_REPLICA, VIA_GATEWAY = "replica", "gateway"
URL_LIKE = re.compile(r"^[a-z][a-z0-9+.-]*://|^/|[:/]", re.I)


def bench_dir() -> Path:
    path = Path(getattr(settings, "BENCH_DATA_DIR", settings.DATA_DIR / "bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_endpoint(ref) -> Endpoint:
    """An endpoint of this console by id or name. URLs and anything else are refused:
    a benchmark never targets an arbitrary address."""
    if isinstance(ref, bool) or ref in (None, ""):
        raise ValidationError({"endpoint": "Choose an endpoint of this console (its id or name)."})
    if isinstance(ref, int) or (isinstance(ref, str) and ref.strip().isdigit()):
        endpoint = Endpoint.objects.select_related("node", "artifact").filter(pk=int(ref)).first()
    elif isinstance(ref, str) and not URL_LIKE.search(ref.strip()):
        endpoint = Endpoint.objects.select_related("node", "artifact").filter(name=ref.strip()).first()
    else:
        raise ValidationError({"endpoint": "Benchmarks target endpoints of this console (an id or name), "
                                           "never a URL or address."})
    if endpoint is None:
        raise ValidationError({"endpoint": f"No endpoint {ref!r} in this console."})
    return endpoint


def _int(data, field, *, low, high, default=None):
    raw = data.get(field, default)
    if raw in (None, ""):
        return default
    if isinstance(raw, bool):
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."})
    try:
        value = int(raw)
        if isinstance(raw, float) and raw != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."}) from None
    if not low <= value <= high:
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."})
    return value


def _float(data, field, *, low, high):
    raw = data.get(field)
    if raw in (None, ""):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValidationError({field: f"Enter a number above {low} and up to {high}."}) from None
    if not (low < value <= high) or math.isnan(value):
        raise ValidationError({field: f"Enter a number above {low} and up to {high}."})
    return value


def _bool(data, field, default):
    raw = data.get(field, default)
    if isinstance(raw, str):
        return raw.strip().lower() in ("1", "true", "on", "yes")
    return bool(raw)


def read_prompt_file(content) -> tuple[list[dict], bytes]:
    """Validate an uploaded prompt file: JSONL, one {"prompt": str, "output_tokens"?: int} per line
    (vLLM's `custom` dataset). Returns the rows and the normalised bytes to store."""
    if isinstance(content, str):
        content = content.encode()
    limit = getattr(settings, "BENCH_PROMPT_FILE_MAX_BYTES", 50 * 1024 * 1024)
    if len(content) > limit:
        raise ValidationError({"prompt_file": f"The prompt file is over {limit // (1024 * 1024)} MiB."})
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError({"prompt_file": "The prompt file must be UTF-8 text (JSONL)."}) from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValidationError({"prompt_file": f"Line {number} is not JSON: {exc.msg}."}) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValidationError({"prompt_file": f'Line {number} needs a non-empty "prompt" string, '
                                                  'e.g. {"prompt": "Hello", "output_tokens": 128}.'})
        tokens = row.get("output_tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1_000_000):
            raise ValidationError({"prompt_file": f'Line {number}: "output_tokens" must be a positive whole number.'})
        rows.append({"prompt": row["prompt"], **({"output_tokens": tokens} if tokens is not None else {})})
    if not rows:
        raise ValidationError({"prompt_file": "The prompt file has no prompts."})
    normalised = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    return rows, normalised


def store_prompt_file(normalised: bytes) -> Path:
    digest = hashlib.sha256(normalised).hexdigest()[:24]
    folder = bench_dir() / "prompts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.jsonl"  # vLLM's custom dataset wants the .jsonl suffix
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(normalised)
        os.replace(tmp, path)
    return path


def clean_workload(data: dict, *, endpoint: Endpoint, prompt_rows: list[dict] | None = None,
                   sweep: bool = False) -> dict:
    """The validated workload of one run (or of every point of a sweep)."""
    with_file = prompt_rows is not None
    max_len = endpoint.max_model_len
    label = str(data.get("label") or "").strip()
    if len(label) > 200:
        raise ValidationError({"label": "Keep the label under 200 characters."})
    replica = _int(data, "replica", low=0, high=10_000)
    if replica is not None and not endpoint.replica_set.filter(index=replica).exists():
        raise ValidationError({"replica": f"{endpoint.name} has no replica {replica}."})
    via = str(data.get("via") or VIA_REPLICA).strip()
    if via not in (VIA_REPLICA, VIA_GATEWAY):
        raise ValidationError({"via": "Benchmark a replica directly ('replica') or through the console's gateway ('gateway')."})
    if via == VIA_GATEWAY:
        if replica is not None:
            raise ValidationError({"replica": "Through the gateway the load goes to every ready replica: leave the replica empty."})
        if not gateway_available():
            raise ValidationError({"via": "This console has no gateway (GATEWAY_URL)."})
    if with_file:
        input_len = None
        output_len = _int(data, "output_len", low=1, high=max_len or 1_000_000)
        if output_len is None and not all("output_tokens" in r for r in prompt_rows):
            output_len = 128
        default_prompts = len(prompt_rows)
    else:
        input_len = _int(data, "input_len", low=1, high=max(1, (max_len or 1_000_000) - 1), default=512)
        output_len = _int(data, "output_len", low=1, high=max_len or 1_000_000, default=128)
        if max_len and input_len + output_len > max_len:
            raise ValidationError({"output_len": f"input_len + output_len = {input_len + output_len} is over the "
                                                 f"endpoint's max_model_len {max_len}."})
        default_prompts = None if sweep else 100
    num_prompts = _int(data, "num_prompts", low=1, high=100_000, default=default_prompts)
    request_rate = _float(data, "request_rate", low=0, high=100_000)
    max_concurrency = _int(data, "max_concurrency", low=1, high=4096)
    if max_concurrency is None and request_rate is None:
        max_concurrency = 32
    workload = {
        "dataset": "file" if with_file else "random",
        "input_len": input_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "max_concurrency": max_concurrency,
        "request_rate": request_rate,
        "num_warmups": _int(data, "num_warmups", low=0, high=1000, default=0),
        "timeout_s": _int(data, "timeout_s", low=10, high=7 * 24 * 3600,
                          default=getattr(settings, "BENCH_DEFAULT_TIMEOUT_SECONDS", 1800)),
        "ignore_eos": _bool(data, "ignore_eos", True),
        "replica": replica,
        "via": via,
        "label": label,
    }
    if sweep:
        workload["concurrencies"] = sweep_levels(data)
    return workload


def sweep_levels(data: dict) -> list[int]:
    """1, 2, 4, … up to N (N included), or the levels given."""
    given = data.get("concurrencies")
    if isinstance(given, str):
        given = [p for p in re.split(r"[,\s]+", given) if p]
    if given:
        try:
            levels = sorted({int(c) for c in given})
        except (TypeError, ValueError):
            raise ValidationError({"concurrencies": "Concurrencies are whole numbers, e.g. 1,2,4,8."}) from None
        if not all(1 <= c <= 4096 for c in levels):
            raise ValidationError({"concurrencies": "Each concurrency is between 1 and 4096."})
    else:
        top = _int(data, "max_concurrency", low=1, high=4096, default=32)
        levels, c = [], 1
        while c < top:
            levels.append(c)
            c *= 2
        levels.append(top)
    if len(levels) > 16:
        raise ValidationError({"concurrencies": "At most 16 levels in one sweep."})
    return levels


def gateway_available() -> bool:
    """The console's gateway (endpoints.gateway): its keys and its address."""
    from importlib import import_module

    try:
        import_module("endpoints.gateway.services")
    except ImportError:
        return False
    return bool(getattr(settings, "GATEWAY_URL", ""))
