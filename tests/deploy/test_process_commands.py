"""deploy/supervisord.conf is where the console's process commands live (`make run`); the systemd units, the
compose file and the Kubernetes manifests run the same commands. A process added or changed in one place and
not in the others fails here."""

import configparser
import json
import re
import shlex

import yaml

from tests.support import ROOT

DEPLOY = ROOT / "deploy"


def _manage_commands(argv: list[str]) -> list[tuple[str, ...]]:
    """The `manage.py …` invocations in an argv (several where a shell line chains them with &&)."""
    found, current = [], None
    for token in argv:
        if token.endswith("manage.py"):
            current = []
            found.append(current)
        elif token in ("&&", ";"):
            current = None
        elif current is not None:
            current.append(token)
    return [tuple(c) for c in found]


def _gunicorn(argv: list[str]) -> bool:
    return (
        any(t.endswith("gunicorn") for t in argv) and "console.wsgi" in argv and "python:console.gunicorn_conf" in argv
    )


def supervised() -> dict[str, list[str]]:
    conf = configparser.RawConfigParser()
    conf.read(DEPLOY / "supervisord.conf")
    return {
        s.split(":", 1)[1]: shlex.split(conf.get(s, "command").replace("\n", " "))
        for s in conf.sections()
        if s.startswith("program:") and "supervisor_echo" not in conf.get(s, "command")
    }


def systemd_argvs() -> list[list[str]]:
    argvs = []
    for unit in (DEPLOY / "systemd").glob("*.service"):
        text = unit.read_text().replace("\\\n", " ")
        argvs += [shlex.split(m) for m in re.findall(r"^ExecStart=(.+)$", text, re.M)]
    return argvs


def image_cmd() -> list[str]:
    """The console image's CMD (deploy/docker/Dockerfile): what a compose service without a command runs."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    return json.loads(re.search(r"^CMD (\[.+\])$", text, re.M).group(1))


def compose_argvs() -> list[list[str]]:
    services = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    argvs = [s.get("command", image_cmd()) for s in services.values() if s.get("image", "").startswith("llm-console:")]
    argvs = [a for a in argvs if isinstance(a, list)]
    return [shlex.split(a[2]) if a[:2] == ["sh", "-c"] else a for a in argvs]


def kubernetes_argvs() -> list[list[str]]:
    argvs = []
    for path in (DEPLOY / "kubernetes").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                if command := container.get("command"):
                    argvs.append(shlex.split(command[2]) if command[:2] == ["sh", "-c"] else command)
    return argvs


def test_every_supervised_process_runs_the_same_command_everywhere():
    programs = supervised()
    assert {"web", "worker", "convert", "bench", "reaper", "agent", "telemetry", "gateway", "controller"} <= set(
        programs
    )
    assert _gunicorn(programs.pop("web"))
    wanted = {cmd for argv in programs.values() for cmd in _manage_commands(argv)}
    agent = ("agent",)
    for where, argvs in (
        ("systemd", systemd_argvs()),
        ("compose", compose_argvs()),
        ("kubernetes", kubernetes_argvs()),
    ):
        have = {cmd for argv in argvs for cmd in _manage_commands(argv)}
        # The gateway binds all interfaces in a container; the rest of its command is the same.
        have = {cmd[:1] if cmd[0] == "gateway" else cmd for cmd in have}
        missing = {cmd for cmd in wanted if cmd != agent} - have
        assert not missing, f"{where} lacks {sorted(missing)}"
        assert any(_gunicorn(argv) for argv in argvs), f"{where}'s web server is not the supervised one"
    assert agent in {cmd for argv in systemd_argvs() for cmd in _manage_commands(argv)}
