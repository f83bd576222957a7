"""Two hosts on one machine, for tests: two network namespaces joined by a veth pair with link-local addresses
(169.254.x.1 and .2, which never leave the machine), each command started in its namespace under a host name of
its own (a UTS namespace per command):

    host A: namespace xdlNa, interface xvNa 169.254.x.1  <--veth-->  host B: namespace xdlNb, interface xvNb 169.254.x.2

Only the namespaces made here are used, and they are removed afterwards with every process still in them. Making
them needs root (CI has it); where that fails, the test is skipped and says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
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
    """The namespace and every process still in it (its veth end goes with it)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)


@contextlib.contextmanager
def two_hosts():
    """(host A, host B), joined; skips the test, saying why, where they cannot be made."""
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
    except subprocess.CalledProcessError as error:
        for namespace in made:
            _remove(namespace)
        pytest.skip(f"two hosts on one machine: `{' '.join(error.cmd)}` failed: {error.stderr.strip()}")
    try:
        yield hosts[0], hosts[1]
    finally:
        for namespace in made:
            _remove(namespace)
