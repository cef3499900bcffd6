"""Process-group set-up shared by the trainer and the elastic worker (below both in the data flow).

c10d's TCPStore server listens on every interface whatever host it is given (checked on torch
2.13: `TCPStore("127.0.0.1", 0, is_master=True)` shows up as `*:PORT`). The store has no
authentication, and anyone who reaches it can steer the job (RELIABILITY.md). So DTorch binds the
listening socket itself, on exactly the requested address, and hands it to TCPStore through
`master_listen_fd` (`tcp_store`). `init_process_group` builds the default process group on such
a store from the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK:
`dtorch run`, torchrun, or a scheduler's variables exported by `dtorch.integrations.env`).

The trainer (`dtorch.train`) and the elastic worker support (`dtorch.elastic.worker`, which adds
its set-up and times the call into the recovery record) both call it; neither imports the other
for it. The rendezvous store of the agent is built on `tcp_store` too (`dtorch.elastic.store`).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dtorch.env import RuntimeEnv, current
from dtorch.errors import ConfigError


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


def init_process_group(backend: str | None = None, timeout: float | None = None,
                       wrap_store: Callable[[Any], Any] | None = None, env: RuntimeEnv | None = None) -> None:
    """`torch.distributed.init_process_group` from the launcher's environment, with its store
    listening on MASTER_ADDR only (torch's own env:// store listens on every interface). Backend
    default: nccl when CUDA is available, else gloo. `timeout` in seconds (default torch's: 30 min);
    shorten it after the first step with `set_collective_timeout`. `wrap_store`, when given, wraps
    the store before the group uses it (the elastic worker signs its values)."""
    import torch
    import torch.distributed as dist

    env = env or current()
    rank, world = env.rank or 0, env.world_size or 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank or 0)
    if env.master_addr is None or env.master_port is None:
        raise ConfigError("MASTER_ADDR" if env.master_addr is None else "MASTER_PORT", None,
                          "start the process with `dtorch run` or torchrun, which set the rendezvous address")
    t = timedelta(seconds=timeout) if timeout is not None else timedelta(minutes=30)
    s = tcp_store(env.master_addr, env.master_port, rank == 0, t, world)
    if wrap_store is not None:
        s = wrap_store(s)
    kw: dict[str, Any] = {"timeout": t} if timeout is not None else {}
    dist.init_process_group(backend, store=s, rank=rank, world_size=world, **kw)


def set_collective_timeout(seconds: float, group: Any = None) -> None:
    """Shorten (or lengthen) the timeout of the process group's collectives, e.g. after the first
    step, so a dead or stopped peer fails a collective in seconds instead of 30 minutes (gloo's
    default). Works for gloo and NCCL in torch 2.13 (`_set_pg_timeout`, private: it sets the
    backend's default timeout, which applies to collectives issued after the call)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), group)


_hosted = False


def hosted() -> None:
    """Mark this process as hosted by a launcher that needs the entry point to return (the elastic
    agent's worker function hands its result back through torch's queue): `leave` then raises
    SystemExit instead of ending the process."""
    global _hosted
    _hosted = True


def leave(code: int) -> None:
    """End this process with `code` after its work is done: destroy the process group, run the
    atexit handlers (logging, W&B, offload files), flush the standard streams, then `os._exit`.

    Skips the interpreter's finalization on purpose. Objects that outlive the group (the device
    mesh cache, a DDP reducer, gloo work objects holding tensors) are destroyed there, and gloo's
    C++ threads can then abort the process ("terminate called without an active exception", seen
    after a finished Slurm job and in 1 probe in 10 on a loaded 2-core machine): a run that
    completed would exit 134. Only for a process's entry point, never from library code; in a
    process marked `hosted` it destroys the group and raises SystemExit(code)."""
    dist = sys.modules.get("torch.distributed")  # a process that never imported it has no group
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _hosted:
        sys.exit(code)
    atexit._run_exitfuncs()  # what finalization would run first, before the objects go
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
