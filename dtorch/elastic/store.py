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

The workers' process-group store (`SignedStore`, used by `dtorch.elastic.worker.init_process_group`)
authenticates its values the same way, keyed for the round.
"""

from __future__ import annotations

import hmac
import io
import logging
import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist

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


# ---- the workers' process-group store: values authenticated -----------------------------------------
_PG_PURPOSE = "dtorch-pg-store/1"
_PG_TAG = 32  # bytes of an HMAC-SHA256


class StoreForgery(RuntimeError):
    """A value in the workers' store does not carry this job's tag."""


class SignedStore(dist.Store):
    """The workers' process-group store with every value authenticated.

    What a process group keeps in its store is the ranks' connection addresses (gloo's, NCCL's),
    read by every peer: whoever could set them could make a rank connect to them and feed its
    collectives (and `all_gather_object` unpickles what it receives). Here each value is stored
    behind an HMAC-SHA256 tag over the key and the value, keyed with the job's secret
    (`dtorch.trust.secret`) for one round (`scope`: run id, membership epoch, port); `get`
    returns a value only when its tag checks and raises `StoreForgery` otherwise, which fails the
    rank's process-group set-up instead of connecting it anywhere. A value can be neither moved
    to another key nor replayed from another round or job. Counters (`add`) and key presence
    (`wait`, `check`) are not authenticated: a forged increment can stall or fail the set-up,
    never redirect a connection."""

    def __init__(self, inner: Any, secret: bytes, scope: str):
        super().__init__()
        self._inner, self._secret, self._scope = inner, secret, scope
        self._purpose = f"{_PG_PURPOSE}|{scope}"

    def _tag(self, name: str, value: bytes) -> bytes:
        return bytes.fromhex(trust.tag(self._purpose, name.encode() + b"\0" + value, self._secret))

    def _seal(self, name: str, value: Any) -> bytes:
        value = value if isinstance(value, bytes) else str(value).encode()
        return self._tag(name, value) + value

    def _open(self, name: str, stored: bytes) -> bytes:
        tag, value = stored[:_PG_TAG], stored[_PG_TAG:]
        if len(stored) < _PG_TAG or not hmac.compare_digest(tag, self._tag(name, value)):
            raise StoreForgery(
                f"the workers' store value under {name!r} failed authentication: set by a process "
                "without this job's key (forged), or by a rank with another key (every rank needs "
                "the same DTORCH_KEY or key file)")
        return value

    def set(self, name: str, value: Any) -> None:
        self._inner.set(name, self._seal(name, value))

    def get(self, name: str) -> bytes:
        return self._open(name, self._inner.get(name))

    def multi_set(self, names: list[str], values: list[Any]) -> None:
        for n, v in zip(names, values, strict=True):
            self.set(n, v)

    def multi_get(self, names: list[str]) -> list[bytes]:
        return [self.get(n) for n in names]

    def compare_set(self, name: str, expected: Any, desired: Any) -> bytes:
        exp = expected if isinstance(expected, bytes) else str(expected).encode()
        got = self._inner.compare_set(name, self._seal(name, exp) if exp else b"", self._seal(name, desired))
        return self._open(name, got)

    def add(self, name: str, amount: int) -> int:
        return self._inner.add(name, amount)

    def wait(self, names: list[str], timeout: Any = None) -> None:
        return self._inner.wait(names) if timeout is None else self._inner.wait(names, timeout)

    def check(self, names: list[str]) -> bool:
        return self._inner.check(names)

    def delete_key(self, name: str) -> bool:
        return self._inner.delete_key(name)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> Any:
        return self._inner.timeout

    def clone(self) -> SignedStore:
        return SignedStore(self._inner.clone(), self._secret, self._scope)
