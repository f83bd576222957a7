"""init_distributed: join (or start) the torch.distributed world with sane defaults.

torchrun, the test harness and the Lab's engines all come through here, so every process gets
the same choices: nccl with one GPU per rank when CUDA is there, gloo otherwise; a timeout of
minutes (a lost rank must not hang a notebook for torch's default 30 minutes); and one torch
thread per rank when several CPU ranks share the cores.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout_s: float


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def env_world_size() -> int:
    """The size of the world init_distributed() joins without arguments: torchrun's WORLD_SIZE, else 1."""
    return _env_int("WORLD_SIZE", 1)


def init_distributed(
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> DistributedInfo:
    """Initialise torch.distributed from torchrun's environment or from explicit arguments.

    Explicit arguments win over RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT. Calling it again in an initialised process returns the current world."""
    if dist.is_initialized():
        return current_info()
    rank = rank if rank is not None else _env_int("RANK", 0)
    world_size = world_size if world_size is not None else env_world_size()
    local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK", rank)
    local_world_size = local_world_size if local_world_size is not None else _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if timeout_s is None or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        if not cuda:
            raise ValueError("backend 'nccl' needs CUDA GPUs; none is visible. Use backend='gloo' on CPU.")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # CPU ranks on one host share its cores; more threads than cores only thrash.
        torch.set_num_threads(max(1, usable_cpu_cores() // max(1, local_world_size)))

    os.environ.setdefault("MASTER_ADDR", master_addr or "127.0.0.1")
    if master_addr:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    if "MASTER_PORT" not in os.environ:
        if world_size > 1:
            raise ValueError("MASTER_PORT is not set: launch with torchrun or pass master_port=")
        os.environ["MASTER_PORT"] = "0"  # a world of one: its own store, on a port the kernel picks when it binds

    # gloo and NCCL bind the interface their host name resolves to, loopback where it resolves to nothing: on
    # several hosts the peers would then dial 127.0.0.1. Without the user's choice, bind the one the master's
    # route leaves by (none on one host, whose route to the master is loopback)
    variable = interface_variable(backend)
    if world_size > 1 and not os.environ.get(variable):
        interface = route_interface(os.environ["MASTER_ADDR"])
        if interface is not None:
            os.environ[variable] = interface
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    _STATE.update(local_rank=local_rank, device=device, timeout_s=timeout_s)
    return current_info()


_STATE: dict = {}


def current_info() -> DistributedInfo:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call xdit_lab.init_distributed() first")
    device = _STATE.get("device") or (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    )
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=_STATE.get("local_rank", dist.get_rank()),
        backend=dist.get_backend(),
        device=device,
        timeout_s=_STATE.get("timeout_s", DEFAULT_TIMEOUT_S),
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()


def usable_cpu_cores() -> int:
    """CPU cores this process may run on. In a container limited to a few cores (a cpuset),
    os.cpu_count() still reports the whole host; the affinity mask reports the cores we have."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def route_interface(address: str) -> str | None:
    """The network interface (Linux) this host reaches `address` through: the one holding the local address a UDP
    socket connected to it takes (connecting a UDP socket sends nothing, it only picks the route). None where the
    route is loopback, the address does not resolve, or no interface holds that local address."""
    import fcntl
    import socket
    import struct

    local = route_source(address)
    if local is None or local.startswith("127."):
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == local:
            return name
    return None


def interface_variable(backend: str) -> str:
    """The environment variable that names the network interface `backend`'s sockets bind."""
    return "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"


def route_source(address: str) -> str | None:
    """This host's IPv4 address on its route to `address` (what a peer there sees it as), or None where `address`
    does not resolve or has no route. A UDP socket connected to it takes that address and sends nothing."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


# The ranks of one job join a store one process serves, as torchrun's workers join their agent's: bound to a port
# the kernel picks (0), where a port picked free and bound later by rank 0 can be taken in between by another
# process (EADDRINUSE). The ranks join with AGENT_STORE in their environment and MASTER_PORT its port.
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def serve_store(world_size: int, timeout_s: float = 60):
    """A rendezvous store for one job of `world_size` ranks, served by this process on every interface, on a port
    of the kernel's choosing (`.port`); it lives as long as the returned object."""
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def free_port() -> int:
    """A TCP port on localhost that is free now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
