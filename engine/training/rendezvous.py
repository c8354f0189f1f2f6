"""Where a run's ranks meet: within a bounded wait, and listening on the main address only.

torch's ``env://`` rendezvous (what accelerate sets up) has two habits a local
tool must not have: its store listens on every interface of the main node
whatever ``MASTER_ADDR`` says (a two-node run at ``--main-address
127.0.0.1:PORT`` is reachable from the LAN), and a rank whose peers never come
waits for half an hour, silently. So each rank joins here, before its
``Accelerator`` is built (accelerate then finds the process group made and
uses it):

* rank 0 binds the store's socket to the main address itself (loopback for a
  loopback address) and hands it to torch's ``TCPStore``;
* for a loopback main address the collectives' own sockets (gloo, NCCL) are
  put on the loopback interface too (``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME``, unless the user set them);
* the wait for every rank is ``join_timeout`` seconds (``train --join-timeout``),
  after which the rank fails with :class:`NodesNotJoined` (``nodes_not_joined``),
  naming the address and how many ranks came.

Across machines, the main node's store port (``--main-address``) and the
collectives' ports (gloo and NCCL pick free ones) must be reachable between the
nodes: a trusted network only, as torch's own docs say (nothing here is
authenticated).
"""

from __future__ import annotations

import datetime
import os
import socket

from engine.errors import EngineError
from engine.network import is_loopback
from engine.requests.training import JOIN_TIMEOUT_S  # the default wait, as the request names it


class NodesNotJoined(EngineError):
    """Not every rank of a multi-process run came to the rendezvous in time."""

    code = "nodes_not_joined"


def rendezvous(backend: str, join_timeout: float) -> None:
    """Make this rank's default process group from the launcher's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), waiting at most
    ``join_timeout`` seconds for the others.

    :raises NodesNotJoined: the others did not come (or node 0's store could not be reached).
    """
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if is_loopback(host):
        interface = loopback_interface()
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    timeout = datetime.timedelta(seconds=join_timeout)
    try:
        # The store owns the listening socket from here (a failed rank exits with it).
        fd = listen_on(host, port).detach() if rank == 0 else None
        store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=True,
                              master_listen_fd=fd)
    except (OSError, RuntimeError) as exc:
        raise NodesNotJoined(_why(rank, world, host, port, join_timeout, exc)) from None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    return None


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host``'s own address (never the wildcard)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def _why(rank: int, world: int, host: str, port: int, seconds: float, exc: BaseException) -> str:
    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if rank == 0 and isinstance(exc, OSError):
        return (f"rank 0 could not listen at {host}:{port} ({said}); give --main-address an address of "
                "this machine and a free port")
    where = f"rank 0 waited at {host}:{port}" if rank == 0 else f"rank {rank} could not reach node 0 at {host}:{port}"
    return (f"{where} for {seconds:g} s and not all {world} ranks joined ({said}); start the same `train` "
            "on every node (each with its --node-rank) or give a longer --join-timeout")
