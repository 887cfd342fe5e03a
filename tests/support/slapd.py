"""A real OpenLDAP server for the LDAP single sign-on tests: Debian's slapd (`apt-get install slapd ldap-utils`, the
Makefile's `sso-servers`), run as a child process on a free port of 127.0.0.1 with a throwaway directory loaded
from tests/fixtures/sso/directory.ldif by slapadd. No system service: the process is the test's, killed after."""

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import ldap
import pytest

from tests.support import ROOT
from tests.support.gateway import free_port

SLAPD = Path("/usr/sbin/slapd")
SLAPADD = Path("/usr/sbin/slapadd")
LDIF = ROOT / "tests" / "fixtures" / "sso" / "directory.ldif"
SUFFIX = "dc=console,dc=test"
ROOT_DN = f"cn=admin,{SUFFIX}"
ROOT_PASSWORD = "slapd-test-root-password"
SCHEMAS = ("core", "cosine", "inetorgperson", "nis")


@dataclass
class Slapd:
    """The running server: its URI, and the root account the tests change the directory with."""

    uri: str
    suffix: str = SUFFIX
    root_dn: str = ROOT_DN
    root_password: str = ROOT_PASSWORD

    def modify(self, dn: str, changes: list) -> None:
        """An LDAP modify as the directory's root (python-ldap's modlist: [(ldap.MOD_DELETE, "member", [b"..."])])."""
        conn = ldap.initialize(self.uri)
        try:
            conn.simple_bind_s(self.root_dn, self.root_password)
            conn.modify_s(dn, changes)
        finally:
            conn.unbind_s()


def _config(workdir: Path) -> Path:
    lines = [f"include /etc/ldap/schema/{name}.schema" for name in SCHEMAS]
    lines += [
        "modulepath /usr/lib/ldap",
        "moduleload back_mdb",
        f"pidfile {workdir / 'slapd.pid'}",
        "database mdb",
        "maxsize 16777216",
        f'suffix "{SUFFIX}"',
        f'rootdn "{ROOT_DN}"',
        f"rootpw {ROOT_PASSWORD}",
        f"directory {workdir / 'db'}",
        # People may bind with their password (simple bind) and read the directory once bound: the console's
        # search for the user and their groups runs anonymously, as with LDAP_BIND_DN unset.
        "access to attrs=userPassword by self write by anonymous auth by * none",
        "access to * by * read",
    ]
    path = workdir / "slapd.conf"
    path.write_text("\n".join(lines) + "\n")
    (workdir / "db").mkdir(mode=0o700)
    return path


@pytest.fixture(scope="module")
def slapd(tmp_path_factory):
    if not SLAPD.exists():
        pytest.skip(f"{SLAPD} not found: apt-get install -y slapd ldap-utils (the Makefile's sso-servers)")
    workdir = tmp_path_factory.mktemp("slapd")
    config = _config(workdir)
    subprocess.run([str(SLAPADD), "-f", str(config), "-l", str(LDIF)], check=True, capture_output=True)
    port = free_port()
    uri = f"ldap://127.0.0.1:{port}"
    # -d 0: in the foreground (a child of the test, not a daemon), logging nothing.
    proc = subprocess.Popen(
        [str(SLAPD), "-d", "0", "-h", f"{uri}/", "-f", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_listening(proc, uri)
        yield Slapd(uri=uri)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_listening(proc, uri: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"slapd exited ({proc.returncode}): {proc.stdout.read().decode(errors='replace')}")
        try:
            conn = ldap.initialize(uri)
            conn.simple_bind_s(ROOT_DN, ROOT_PASSWORD)
            conn.unbind_s()
            return
        except ldap.SERVER_DOWN:
            time.sleep(0.1)
    raise RuntimeError(f"slapd did not answer at {uri} within {timeout} s")
