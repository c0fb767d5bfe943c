"""Keep a loopback Ray cluster on loopback: `python -m smolforge.cluster.nodes.ray_loopback start ...` is `ray start`
with node address 127.0.0.1 kept as given.

Why: Ray rewrites a node address of 127.0.0.1 to this machine's LAN address
(`ray._private.services.resolve_ip_for_localhost`, "make sure localhost isn't resolved to the loopback
ip"), and then its GCS, raylet, core workers and agents listen on every interface. With a node address
of 127.0.0.1 Ray 2.60 binds all of them to loopback. A coordinator started with `--host 127.0.0.1` (the
default) promises exactly that, so for such a cluster the head, every worker that joins it and every
driver (the coordinator, the embedded cluster) keep 127.0.0.1.

Ray's own switch for this (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) also refuses `ray start --address`,
so workers could not join; replacing the one resolver is the narrowest change. It is only made in
processes that talk to a loopback cluster: a node that others must reach keeps Ray's behaviour.
"""

from __future__ import annotations

import sys

from smolforge.net import is_loopback


def keep_loopback() -> None:
    """From now on, Ray in this process keeps a loopback host as the node address (idempotent)."""
    from ray._private import services

    original = services.resolve_ip_for_localhost
    if getattr(original, "keeps_loopback", False):
        return

    def resolve(host: str) -> str:
        return host if host and is_loopback(host) else original(host)

    resolve.keeps_loopback = True  # type: ignore[attr-defined]
    services.resolve_ip_for_localhost = resolve


def main(argv: list[str]) -> None:
    keep_loopback()
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *argv]
    ray_main()


if __name__ == "__main__":
    main(sys.argv[1:])
