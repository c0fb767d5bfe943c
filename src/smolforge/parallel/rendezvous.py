"""Our own rendezvous: rank 0 names its address and a free port, every rank joins the group there.

Why not Ray Train: on this hardware it cost ~5x per step and wants shared storage for multi-node
checkpoints. Ray only places the actors and carries rank 0's address to the others (`ray_glue.node_ip`);
the collectives are plain torch.distributed (gloo on CPU, NCCL on GPU). No Ray here.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from smolforge.net import is_loopback


def listen_socket(ip: str) -> socket.socket:
    """A socket listening on `ip` only, at a free port, for rank 0's rendezvous store.

    Bound here and handed to the store by file descriptor: `tcp://` rendezvous lets torch's TCPStore
    listen on every interface, and a port found free and then released can be taken in between."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))
    sock.listen(128)
    return sock


_ifname = [""]  # the GLOO_SOCKET_IFNAME init_group set last ("": none): a later group may pick again


def interface_towards(addr: str) -> str | None:
    """The name of this machine's network interface whose address reaches `addr` (None: not found)."""
    import psutil

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP: the kernel picks the route and the source address; nothing is sent
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == family and a.address.split("%")[0] == local for a in addrs):
            return name
    return None


def pick_backend(backend: str = "auto", device: str = "auto") -> str:
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"


def init_group(backend: str, master_addr: str, master_port: int, rank: int, world: int, timeout_s: float,
               secret: str, listen: socket.socket | None = None) -> None:
    """Join the process group; gloo binds to the interface that reaches rank 0.

    Rank 0 serves the rendezvous store on `listen` (bound to the group's address only). Every key lives
    under the job's `secret`, which only the group's ranks received (through Ray, which takes the
    cluster token): anyone else who reaches the store's port can neither read nor write the group's keys.
    """
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", "0")  # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
    # gloo's own choice is the address the host name resolves to: 127.0.1.1 on Debian, which no other
    # machine reaches ("connectFullMesh failed ... remote=[127.0.0.1]"). A value the user set wins.
    if backend == "gloo" and os.environ.get("GLOO_SOCKET_IFNAME", _ifname[0]) == _ifname[0]:
        iface = "lo" if is_loopback(master_addr) else interface_towards(master_addr)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = _ifname[0] = iface
    timeout = timedelta(seconds=timeout_s)
    if listen is not None:  # the store owns the socket from here on
        store = dist.TCPStore(master_addr, master_port, world, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listen.detach())
    else:  # rank 0 without a socket of its own (tests): the store listens where TCPStore puts it
        store = dist.TCPStore(master_addr, master_port, world, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{secret}/", store), rank=rank, world_size=world,
                            timeout=timeout)


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
