"""TCPStores that listen only where they are told to.

c10d's TCPStore server listens on every interface whatever host it is given (checked on torch
2.13: `TCPStore("127.0.0.1", 0, is_master=True)` shows up as `*:PORT`). The store has no
authentication, and anyone who reaches it can steer the job (RELIABILITY.md). So DTorch binds the
listening socket itself, on exactly the requested address, and hands it to TCPStore through
`master_listen_fd` (`dtorch.process_group.tcp_store`). Used here for the rendezvous store (agent
side); the workers' process-group store is built the same way (`dtorch.process_group`).

The rendezvous state is a pickle that torch's handler unpickles on every sync, so anyone who
can reach the store could make every agent run code by setting the rendezvous key. `SignedBackend`
sits between torch's handler and the store: what it writes carries an HMAC-SHA256 keyed with the
job's secret (`dtorch.trust.secret`: DTORCH_KEY in the launch environment of every node, or a
0600 key file), and what it reads is handed to torch only when the tag matches. A value that
fails the check is never unpickled: the handler sees an empty state in its place (with the
store's token, so its next write replaces the forgery) and the job re-forms its rendezvous.
DTorch's own reads of the state (`read_state`) go through the same check and an allow-list.
"""

from __future__ import annotations

import io
import logging
import pickle
from datetime import timedelta
from typing import Any

from dtorch import trust
from dtorch.elastic import torch_compat
from dtorch.process_group import tcp_store  # the bound-socket store, below the trainer and the workers

log = logging.getLogger("dtorch.elastic")
_PURPOSE = "dtorch-rendezvous-state/1"
_TAG_LEN = 64  # hex digits of an HMAC-SHA256


def rendezvous_handler(params: Any) -> Any:
    """torch's c10d dynamic rendezvous handler over a store that listens on the endpoint's address
    only (instead of `registry.get_rendezvous_handler`, whose store listens on all interfaces).
    The first agent on the endpoint's host serves the store; the others connect to it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
    is_host = params.get_as_bool("is_host")
    store = None
    if is_host is None or is_host:
        if is_host or torch_compat.matches_machine_hostname(host):
            try:
                store = tcp_store(host, port, True, timeout, multi_tenant=True)
            except OSError:
                if is_host:
                    raise
                # another agent on this host serves the store already: join it as a client
    if store is None:
        store = tcp_store(host, port, False, timeout, multi_tenant=True)
    backend = SignedBackend(C10dRendezvousBackend(store, params.run_id), trust.secret())
    return create_handler(store, backend, params)


class SignedBackend:
    """A rendezvous backend (torch's `RendezvousBackend` interface: name, get_state, set_state)
    that signs what it stores and verifies what it reads (see above)."""

    def __init__(self, inner: Any, key: bytes):
        self._inner = inner
        self._key = key
        self.rejected = 0
        """How many forged or foreign values were read (and not unpickled)."""

    @property
    def name(self) -> str:
        return self._inner.name

    def _open(self, got: Any) -> Any:
        """(payload, token) when the stored bits carry a valid tag; a fresh empty state otherwise."""
        if got is None:
            return None
        bits, token = got[0], got[1]
        tag, payload = bits[:_TAG_LEN], bits[_TAG_LEN:]
        if trust.check_tag(_PURPOSE, payload, tag, self._key):
            return (payload, token, *got[2:])
        self.rejected += 1
        if self.rejected == 1:  # once: a mismatch would repeat on every sync
            log.warning("dtorch: the rendezvous state in the store failed authentication and was ignored: "
                        "forged, or written by an agent with another key (every agent of a job needs the "
                        "same DTORCH_KEY or key file)")
        # our own pickle of an empty state: safe for torch to unpickle; a bitwise comparison with
        # what we wrote (set_state's success test) is False, so torch retries with this token
        return (torch_compat.empty_rendezvous_state(), token, *([False] if len(got) > 2 else []))

    def get_state(self) -> Any:
        return self._open(self._inner.get_state())

    def set_state(self, state: bytes, token: Any = None) -> Any:
        signed = trust.tag(_PURPOSE, state, self._key).encode() + state
        got = self._inner.set_state(signed, token)
        if got is None:
            return None
        opened = self._open(got[:2])
        return (opened[0], opened[1], bool(got[2]) and opened[0] == state)


class _StateUnpickler(pickle.Unpickler):
    _ALLOWED = {("datetime", "datetime"), ("datetime", "timedelta"), ("datetime", "timezone"),
                *torch_compat.RENDEZVOUS_STATE_CLASSES}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refused {module}.{name}: not part of a rendezvous state")
        return super().find_class(module, name)


def read_state(backend: Any) -> Any:
    """The rendezvous state (verified by `SignedBackend`, unpickled with an allow-list), or None."""
    got = backend.get_state()
    return _StateUnpickler(io.BytesIO(got[0])).load() if got is not None else None
