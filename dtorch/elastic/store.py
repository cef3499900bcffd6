"""TCPStores that listen only where they are told to.

c10d's TCPStore server listens on every interface whatever host it is given (checked on torch
2.13: `TCPStore("127.0.0.1", 0, is_master=True)` shows up as `*:PORT`). The store has no
authentication, and anyone who reaches it can steer the job (RELIABILITY.md). So DTorch binds the
listening socket itself, on exactly the requested address, and hands it to TCPStore through
`master_listen_fd`. Used for the rendezvous store (agent side) and for the workers' process-group
store (`dtorch.elastic.worker.init_process_group`).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
        s.listen(2048)
    except OSError:
        s.close()
        raise
    return s


def tcp_store(host: str, port: int, is_server: bool, timeout: timedelta, world_size: int | None = None,
              multi_tenant: bool = False) -> Any:
    """A TCPStore at host:port. When `is_server`, its listening socket is bound to `host` only
    (port 0 picks a free one: read `.port`). Raises OSError when the address is taken."""
    from torch.distributed import TCPStore

    if not is_server:
        return TCPStore(host, port, world_size, False, timeout, multi_tenant=multi_tenant)
    s = _listen(host, port)
    bound = s.getsockname()[1]
    # detach(): the store owns the descriptor now; a garbage-collected socket object must not close it.
    return TCPStore(host, bound, world_size, True, timeout, wait_for_workers=False,
                    multi_tenant=multi_tenant, master_listen_fd=s.detach())


def rendezvous_handler(params: Any) -> Any:
    """torch's c10d dynamic rendezvous handler over a store that listens on the endpoint's address
    only (instead of `registry.get_rendezvous_handler`, whose store listens on all interfaces).
    The first agent on the endpoint's host serves the store; the others connect to it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
    is_host = params.get_as_bool("is_host")
    store = None
    if is_host is None or is_host:
        if is_host or _matches_machine_hostname(host):
            try:
                store = tcp_store(host, port, True, timeout, multi_tenant=True)
            except OSError:
                if is_host:
                    raise
                # another agent on this host serves the store already: join it as a client
    if store is None:
        store = tcp_store(host, port, False, timeout, multi_tenant=True)
    return create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
