"""Benchmark workloads: which endpoint, what load, which prompts; checked before anything is queued."""

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

from console.validation import int_in_range
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
        raise ValidationError(
            {"endpoint": "Benchmarks target endpoints of this console (an id or name), never a URL or address."}
        )
    if endpoint is None:
        raise ValidationError({"endpoint": f"No endpoint {ref!r} in this console."})
    return endpoint


def _rate(value: float | None) -> float | None:
    """A request rate in (0, 100000] req/s, or None (all at once)."""
    if value is None:
        return None
    if not (0 < value <= 100_000) or math.isnan(value):
        raise ValidationError({"request_rate": "Enter a number above 0 and up to 100000."})
    return value


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
            raise ValidationError(
                {
                    "prompt_file": f'Line {number} needs a non-empty "prompt" string, '
                    'e.g. {"prompt": "Hello", "output_tokens": 128}.'
                }
            )
        tokens = row.get("output_tokens")
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1_000_000
        ):
            raise ValidationError({"prompt_file": f'Line {number}: "output_tokens" must be a positive whole number.'})
        rows.append({"prompt": row["prompt"], **({"output_tokens": tokens} if tokens is not None else {})})
    if not rows:
        raise ValidationError({"prompt_file": "The prompt file has no prompts."})
    normalised = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    return rows, normalised


def prompt_file_path(normalised: bytes) -> Path:
    """Where a prompt file's content is kept (named by its digest: the same prompts, one file)."""
    digest = hashlib.sha256(normalised).hexdigest()[:24]
    return bench_dir() / "prompts" / f"{digest}.jsonl"  # vLLM's custom dataset wants the .jsonl suffix


def store_prompt_file(normalised: bytes) -> Path:
    path = prompt_file_path(normalised)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(normalised)
        os.replace(tmp, path)
    return path


@dataclass(frozen=True, kw_only=True)
class WorkloadRequest:
    """What an operator asked for, already parsed (by the bench form or the API schema); None: the default.
    clean_workload() checks it against the endpoint."""

    label: str = ""
    replica: int | None = None
    via: str = VIA_REPLICA
    num_prompts: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    max_concurrency: int | None = None
    request_rate: float | None = None
    num_warmups: int | None = None
    timeout_s: int | None = None
    ignore_eos: bool = True
    seed: int | None = None  # the client's sampling of prompts and arrival times (`vllm bench serve --seed`)
    concurrencies: list[int] | None = None  # a sweep's levels (default: 1, 2, 4, … max_concurrency)

    @classmethod
    def from_params(cls, params: dict) -> "WorkloadRequest":
        """The request behind a job's stored parameters (a retry)."""
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})


def clean_workload(
    wanted: WorkloadRequest, *, endpoint: Endpoint, prompt_rows: list[dict] | None = None, sweep: bool = False
) -> dict:
    """The validated workload of one run (or of every point of a sweep)."""
    with_file = prompt_rows is not None
    max_len = endpoint.max_model_len
    label = (wanted.label or "").strip()
    if len(label) > 200:
        raise ValidationError({"label": "Keep the label under 200 characters."})
    replica = int_in_range(wanted.replica, "replica", low=0, high=10_000)
    if replica is not None and not endpoint.replica_set.filter(index=replica).exists():
        raise ValidationError({"replica": f"{endpoint.name} has no replica {replica}."})
    via = (wanted.via or VIA_REPLICA).strip()
    if via not in (VIA_REPLICA, VIA_GATEWAY):
        raise ValidationError(
            {"via": "Benchmark a replica directly ('replica') or through the console's gateway ('gateway')."}
        )
    if via == VIA_GATEWAY:
        if replica is not None:
            raise ValidationError(
                {"replica": "Through the gateway the load goes to every ready replica: leave the replica empty."}
            )
        if not gateway_available():
            raise ValidationError({"via": "This console has no gateway (GATEWAY_URL)."})
    if with_file:
        input_len = None
        output_len = int_in_range(wanted.output_len, "output_len", low=1, high=max_len or 1_000_000)
        if output_len is None and not all("output_tokens" in r for r in prompt_rows):
            output_len = 128
        default_prompts = len(prompt_rows)
    else:
        input_len = int_in_range(
            wanted.input_len, "input_len", low=1, high=max(1, (max_len or 1_000_000) - 1), default=512
        )
        output_len = int_in_range(wanted.output_len, "output_len", low=1, high=max_len or 1_000_000, default=128)
        if max_len and input_len + output_len > max_len:
            raise ValidationError(
                {
                    "output_len": f"input_len + output_len = {input_len + output_len} is over the "
                    f"endpoint's max_model_len {max_len}."
                }
            )
        default_prompts = None if sweep else 100
    num_prompts = int_in_range(wanted.num_prompts, "num_prompts", low=1, high=100_000, default=default_prompts)
    request_rate = _rate(wanted.request_rate)
    max_concurrency = int_in_range(wanted.max_concurrency, "max_concurrency", low=1, high=4096)
    if max_concurrency is None and request_rate is None:
        max_concurrency = 32
    workload = {
        "dataset": "file" if with_file else "random",
        "input_len": input_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "max_concurrency": max_concurrency,
        "request_rate": request_rate,
        "num_warmups": int_in_range(wanted.num_warmups, "num_warmups", low=0, high=1000, default=0),
        "timeout_s": int_in_range(
            wanted.timeout_s,
            "timeout_s",
            low=10,
            high=7 * 24 * 3600,
            default=getattr(settings, "BENCH_DEFAULT_TIMEOUT_SECONDS", 1800),
        ),
        "ignore_eos": bool(wanted.ignore_eos),
        # Named in the command even at vLLM's default, so the saved command repeats the same prompts and arrivals.
        "seed": int_in_range(wanted.seed, "seed", low=0, high=2**31 - 1, default=0),
        "replica": replica,
        "via": via,
        "label": label,
    }
    if sweep:
        workload["concurrencies"] = sweep_levels(
            concurrencies=wanted.concurrencies, max_concurrency=wanted.max_concurrency
        )
    return workload


def sweep_levels(*, concurrencies: list[int] | None = None, max_concurrency: int | None = None) -> list[int]:
    """1, 2, 4, … up to N (N included), or the levels given."""
    if concurrencies:
        levels = sorted(set(concurrencies))
        if not all(1 <= c <= 4096 for c in levels):
            raise ValidationError({"concurrencies": "Each concurrency is between 1 and 4096."})
    else:
        top = int_in_range(max_concurrency, "max_concurrency", low=1, high=4096, default=32)
        levels, c = [], 1
        while c < top:
            levels.append(c)
            c *= 2
        levels.append(top)
    if len(levels) > 16:
        raise ValidationError({"concurrencies": "At most 16 levels in one sweep."})
    return levels


def parse_levels(text: str) -> list[int]:
    """A sweep's levels as typed in the form: "1, 2 4,8" (blank: none given)."""
    try:
        return [int(p) for p in re.split(r"[,\s]+", text) if p]
    except ValueError:
        raise ValidationError({"concurrencies": "Concurrencies are whole numbers, e.g. 1,2,4,8."}) from None


def gateway_available() -> bool:
    """The console's gateway (endpoints.gateway): its keys and its address."""
    from importlib import import_module

    try:
        import_module("endpoints.gateway.services")
    except ImportError:
        return False
    return bool(getattr(settings, "GATEWAY_URL", ""))
