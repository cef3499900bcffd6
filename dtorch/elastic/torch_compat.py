"""Every use of torch's private elastic internals, in one place.

DTorch's agent extends torch's `LocalElasticAgent` through its protected hooks (`_rendezvous`,
`_start_workers`, `_stop_workers`, `_monitor_workers`, `_shutdown`: the methods torch's own
subclasses override) and its public API (`get_worker_group`, the rendezvous handler's
`num_nodes_waiting`, `shutdown`). What it needs beyond that reads names torch does not promise to
keep; each is read here and nowhere else, so that a torch upgrade is checked in one file:

- the rendezvous round, node name, keep-alive settings and backend of the c10d dynamic handler
  (`DynamicRendezvousHandler._state_holder`, `._this_node`, `._settings`);
- the exit codes of every local worker, not only the first failure torch reports
  (`LocalElasticAgent._pcontext._pc.processes`, forkserver start only);
- the agent's restart budget (`SimpleElasticAgent._remaining_restarts`);
- an empty rendezvous state and the hostname test the c10d handler factory uses
  (`dynamic_rendezvous._RendezvousState`, `utils._matches_machine_hostname`), and the classes a
  rendezvous state pickle may name (`_NodeDesc`, `_RendezvousState`), for `dtorch.elastic.store`.

(The one private name of torch.distributed proper that DTorch uses, `_set_pg_timeout`, lives with
the rest of the process-group set-up in `dtorch.process_group`, below the trainer.)

Checked on torch `CHECKED_ON` (tests/elastic/test_torch_compat.py runs every accessor against a
real c10d rendezvous). Where a name is missing (another torch, another rendezvous backend) the
accessors return None and the caller falls back (the agent's own restart count for the round, no
node-loss watch), except `forbid_restarts`, which raises: without it an error no restart can fix
would be retried.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

CHECKED_ON = ("2.13.0",)
"""torch versions (without the local suffix such as +cpu) this module was checked against."""

DYNAMIC_RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
RENDEZVOUS_STATE_CLASSES = frozenset({(DYNAMIC_RENDEZVOUS, "_NodeDesc"), (DYNAMIC_RENDEZVOUS, "_RendezvousState")})
"""The torch classes a pickled rendezvous state names (besides datetime's)."""


def torch_checked() -> bool:
    """Whether the installed torch is one this module was checked on."""
    import torch

    return torch.__version__.split("+")[0] in CHECKED_ON


def _dynamic(handler: Any) -> Any:
    """The c10d dynamic handler under DTorch's wrappers (which delegate attributes), or None."""
    return handler if getattr(handler, "_state_holder", None) is not None else None


def rendezvous_round(handler: Any) -> int | None:
    """The round of the last rendezvous this handler took part in (the membership epoch)."""
    h = _dynamic(handler)
    try:
        return int(h._state_holder.state.round)  # type: ignore[union-attr]
    except AttributeError:
        return None


def rendezvous_backend(handler: Any) -> Any:
    """The backend the handler stores its state through (DTorch's `SignedBackend`), or None."""
    h = _dynamic(handler)
    return getattr(h._state_holder, "_backend", None) if h is not None else None


def this_node(handler: Any) -> str | None:
    """This agent's node name in the rendezvous state (`host_pid_n`), or None."""
    node = getattr(_dynamic(handler), "_this_node", None)
    return str(node) if node is not None else None


def keep_alive_expiry(handler: Any) -> timedelta | None:
    """How long after its last keep-alive a node counts as gone (interval x allowed misses)."""
    settings = getattr(_dynamic(handler), "_settings", None)
    try:
        return settings.keep_alive_interval * settings.keep_alive_max_attempt  # type: ignore[union-attr]
    except AttributeError:
        return None


def local_exit_codes(agent: Any) -> dict[int, int]:
    """local rank -> exit code of every local worker that has exited, as torch's process context
    sees it ({} when that is not readable: torch then reports only its first failure)."""
    procs = getattr(getattr(getattr(agent, "_pcontext", None), "_pc", None), "processes", None)
    out: dict[int, int] = {}
    for local_rank, p in enumerate(procs or ()):
        code = getattr(p, "exitcode", None)
        if code is not None:
            out[local_rank] = code
    return out


def remaining_restarts(agent: Any) -> int:
    """How many restarts torch's agent loop has left."""
    return int(agent._remaining_restarts)


def forbid_restarts(agent: Any) -> None:
    """Make torch's agent loop end the job at the current failure instead of restarting."""
    if not hasattr(agent, "_remaining_restarts"):
        raise RuntimeError("torch's elastic agent has no _remaining_restarts (torch changed: see "
                           "dtorch/elastic/torch_compat.py)")
    agent._remaining_restarts = 0


def empty_rendezvous_state() -> bytes:
    """The pickle of an empty rendezvous state, as the c10d handler would read it."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    return pickle.dumps(_RendezvousState())


def matches_machine_hostname(host: str) -> bool:
    """Whether `host` names this machine (the c10d handler's test for serving the store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))

