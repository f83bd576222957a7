"""Two hosts on one machine, for tests: two network namespaces joined by a veth pair with link-local addresses
(169.254.x.1 and .2, which never leave the machine), each command started in its namespace under a host name of
its own (a UTS namespace per command):

    host A: namespace xdlNa, interface xvNa 169.254.x.1  <--veth-->  host B: namespace xdlNb, interface xvNb 169.254.x.2

Host names resolve to nothing by default (gloo then falls back to loopback: what init_distributed's interface
choice is for). `two_hosts(names_resolve=True)` gives each namespace a hosts file naming both hosts' addresses, as a
site's DNS would (`ip netns exec` mounts /etc/netns/NAMESPACE/hosts over /etc/hosts): torch's c10d rendezvous
looks its own host name up. Only the namespaces made here are used, and they are removed afterwards with every
process still in them, their hosts files with them. Making them needs root (CI has it); where that fails, the test
is skipped and says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    name: str  # its host name (socket.gethostname() inside)
    namespace: str
    interface: str
    address: str

    def argv(self, command: list[str]) -> list[str]:
        """`command` run on this host: in its namespace, under its host name."""
        rename = f'hostname {self.name} && exec "$@"'
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", rename, "sh", *command]


def _ip(*arguments: str, namespace: str | None = None) -> None:
    command = ["ip", *arguments] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *arguments]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)


def _remove(namespace: str) -> None:
    """The namespace, every process still in it (its veth end goes with it) and its hosts file."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
    shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


@contextlib.contextmanager
def two_hosts(names_resolve: bool = False):
    """(host A, host B), joined; with `names_resolve`, each host's name resolves to its address on both. Skips the
    test, saying why, where they cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("two hosts on one machine need network namespaces, which only root can make")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"two hosts on one machine need {' and '.join(missing)} (iproute2, util-linux)")
    tag = os.getpid() % 10000
    subnet = f"169.254.{tag % 250 + 1}"
    hosts = [
        Host(f"host-{side}", f"xdl{tag}{side}", f"xv{tag}{side}", f"{subnet}.{i + 1}") for i, side in enumerate("ab")
    ]
    made = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("addr", "add", f"{host.address}/24", "dev", host.interface, namespace=host.namespace)
            _ip("link", "set", host.interface, "up", namespace=host.namespace)
            _ip("link", "set", "lo", "up", namespace=host.namespace)
        if names_resolve:
            names = "".join(f"{host.address} {host.name}\n" for host in hosts)
            for host in hosts:
                os.makedirs(f"/etc/netns/{host.namespace}", exist_ok=True)
                with open(f"/etc/netns/{host.namespace}/hosts", "w") as hosts_file:
                    hosts_file.write("127.0.0.1 localhost\n" + names)
    except (subprocess.CalledProcessError, OSError) as error:
        for namespace in made:
            _remove(namespace)
        why = f"`{' '.join(error.cmd)}` failed: {error.stderr.strip()}" if hasattr(error, "cmd") else error
        pytest.skip(f"two hosts on one machine: {why}")
    try:
        yield hosts[0], hosts[1]
    finally:
        for namespace in made:
            _remove(namespace)


@contextlib.contextmanager
def ssh_servers(hosts, folder):
    """sshd on each of `hosts`, listening on its address, taking a key made here (in `folder`) for root; yields the
    ssh arguments that log in with it (for ssh, scp, and ipyparallel's SSH launchers). Skips the test, saying why,
    where sshd is not installed (`make pytest` installs openssh-server where it runs as root)."""
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if sshd is None:
        pytest.skip("engines started over SSH need sshd (Debian: apt-get install openssh-server)")
    for name in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True, timeout=30
        )
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    servers = []
    try:
        for host in hosts:
            options = dict(
                ListenAddress=host.address, AuthorizedKeysFile=folder / "authorized_keys", StrictModes="no",
                PermitRootLogin="prohibit-password", UsePAM="no", PidFile="none", Subsystem="sftp internal-sftp",
            )  # fmt: skip
            command = [sshd, "-D", "-e", "-f", "/dev/null", "-h", str(folder / "host_key")]
            command += [arg for key, value in options.items() for arg in ("-o", f"{key}={value}")]
            log = open(folder / f"sshd-{host.name}.log", "w")  # noqa: SIM115 (closed with the server)
            servers.append((subprocess.Popen(host.argv(command), stdout=log, stderr=subprocess.STDOUT), log))
        arguments = ["-i", str(folder / "client_key"), "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"]
        arguments += ["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        for host in hosts:  # each server up: a login from host A (sshd needs a moment to listen)
            for _ in range(50):
                login = subprocess.run(
                    hosts[0].argv(["ssh", *arguments, host.address, "hostname"]), capture_output=True, text=True
                )
                if login.returncode == 0:
                    assert login.stdout.strip() == host.name, login.stdout
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"sshd on {host.name} did not take a login: {login.stderr.strip()}")
        yield arguments
    finally:
        for server, log in servers:
            server.kill()
            server.wait(timeout=30)
            log.close()
