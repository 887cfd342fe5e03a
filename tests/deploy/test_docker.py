"""deploy/docker, checked by hadolint (the Dockerfile linter, with ShellCheck for the RUN lines)."""

import re
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY, assert_clean, assert_refused, run, tool

DOCKERFILES = sorted(path for path in (DEPLOY / "docker").glob("Dockerfile*") if path.suffix != ".dockerignore")


def hadolint(path) -> object:
    return run([tool("hadolint"), "--no-color", str(path)])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    assert_clean(hadolint(dockerfile))


def test_both_images_are_there():
    assert [path.name for path in DOCKERFILES] == ["Dockerfile", "Dockerfile.agent"]
    assert "FROM python:3.11-slim" in (DEPLOY / "docker/Dockerfile").read_text()
    # The release the console's Ascend engine set follows (requirements/engine-ascend.txt, Makefile).
    assert "quay.io/ascend/vllm-ascend:v0.23.0" in (DEPLOY / "docker/Dockerfile.agent").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_no_secret_is_baked_in(dockerfile):
    """Settings that are secrets come at run time (NAME or NAME_FILE); an image keeps every ENV and ARG."""
    for line in dockerfile.read_text().splitlines():
        if line.startswith(("ENV ", "ARG ")):
            assert not re.search(r"SECRET|PASSWORD|TOKEN|DATABASE_URL|REDIS_URL", line), line


@pytest.mark.parametrize(
    "change, rule",
    [
        (("USER 10001:10001", "USER root"), "DL3002"),  # the last USER is root
        (("COPY . .", "ADD . ."), "DL3020"),
        (("RUN python -m venv", "RUN cd /tmp && python -m venv"), "DL3003"),  # cd in RUN, not WORKDIR
    ],
)
def test_hadolint_refuses_a_broken_dockerfile(tmp_path, change, rule):
    broken = tmp_path / "Dockerfile"
    broken.write_text((DEPLOY / "docker/Dockerfile").read_text().replace(*change, 1))
    assert_refused(hadolint(broken), rule)


def _apt_packages(text: str, stage: str) -> dict[str, str]:
    """name -> pinned version of the `apt-get install` lines in one stage of the Dockerfile `text`."""
    stages = re.split(r"^FROM ", text, flags=re.M)
    [body] = [s for s in stages if s.split("\n", 1)[0].strip().endswith(stage)]
    return dict(
        re.findall(r"\b([a-z0-9][a-z0-9.+-]+)=([0-9][^\s\\]*)", body.split("apt-get install", 1)[1].split("&&")[0])
    )


DEBIAN_VERSION = Path("/etc/debian_version")


@pytest.mark.skipif(
    not (DEBIAN_VERSION.is_file() and DEBIAN_VERSION.read_text().startswith("12")),
    reason="Debian 12's package data: the release of the image's stages",
)
def test_the_image_installs_ldap_and_its_runtime_library_covers_what_python_ldap_links():
    """The build stage compiles python-ldap (requirements/sso-ldap.txt); the runtime stage's packages must carry every
    library the built `_ldap` module links. Checked on this host (Debian 12, the release of the image's stages) with
    the module this venv built from the same pins: each library `ldd` lists belongs (dpkg -S) to a package in the
    dependency closure of the runtime stage's packages (apt-cache depends --recurse), and each pin is the version
    installed here or one Debian 12's lists have (apt-cache madison), so a pin gone stale fails here before a build
    does."""
    text = (DEPLOY / "docker/Dockerfile").read_text()
    assert "requirements/sso-ldap.txt" in text and "-r /tmp/sso-ldap.txt" in text
    build, runtime = _apt_packages(text, "AS build"), _apt_packages(text, "python:3.11-slim-bookworm")
    assert {"gcc", "libldap2-dev", "libsasl2-dev"} <= set(build) and set(runtime) == {"libldap-2.5-0"}
    for name, version in {**build, **runtime}.items():  # installed here (the Makefile's venv target), or listed
        installed = run(["dpkg-query", "-W", "-f", "${Version}", name]).stdout
        assert version == installed or f" {version} " in run(["apt-cache", "madison", name]).stdout, (
            f"{name}={version} is neither installed ({installed!r}) nor in Debian 12's lists"
        )

    import _ldap  # the module python-ldap built here

    linked = re.findall(r"=> (/\S+)", run(["ldd", _ldap.__file__]).stdout)
    assert any("libldap" in path for path in linked), linked
    closure = set(
        run(
            [
                "apt-cache",
                "depends",
                "--recurse",
                "--no-recommends",
                "--no-suggests",
                "--no-conflicts",
                "--no-breaks",
                "--no-replaces",
                "--no-enhances",
                *runtime,
            ]
        ).stdout.split()
    )
    for path in linked:
        owner = run(["dpkg", "-S", str(Path(path).resolve())]).stdout.split(":", 1)[0]
        if not owner:  # merged /usr: dpkg knows the /lib path
            owner = run(["dpkg", "-S", path]).stdout.split(":", 1)[0]
        assert owner in closure, f"{path} ({owner}) is not brought by {sorted(runtime)}"
