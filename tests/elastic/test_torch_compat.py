"""The adapter over torch's private elastic internals, against the installed torch: every accessor
reads what it claims from a real c10d rendezvous (one node, in this process), so a torch upgrade
that renames one fails here, in one place, instead of silently disabling a detector."""

from __future__ import annotations

import uuid
import warnings

import torch

from dtorch.elastic import store, torch_compat


def test_torch_compat_reads_a_real_rendezvous_on_the_checked_torch():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    if not torch_compat.torch_checked():
        warnings.warn(f"torch {torch.__version__} is not in torch_compat.CHECKED_ON {torch_compat.CHECKED_ON}: "
                      "check dtorch/elastic/torch_compat.py against it", stacklevel=1)
    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id=f"compat-{uuid.uuid4().hex[:8]}",
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1", last_call_timeout=1,
                                  keep_alive_interval=1, keep_alive_max_attempt=5, join_timeout=30)
    handler = store.rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        assert torch_compat.rendezvous_round(handler) == 0
        node = torch_compat.this_node(handler)
        assert isinstance(node, str) and node
        assert torch_compat.keep_alive_expiry(handler).total_seconds() == 5.0
        backend = torch_compat.rendezvous_backend(handler)
        assert isinstance(backend, store.SignedBackend)
        state = store.read_state(backend)  # the allow-list (RENDEZVOUS_STATE_CLASSES) admits it
        assert {str(n) for n in state.participants} == {node} and state.complete
    finally:
        handler.shutdown()
    # what store.py needs: an empty state that torch can read back
    assert store._StateUnpickler(__import__("io").BytesIO(torch_compat.empty_rendezvous_state())).load().round == 0


def test_torch_compat_degrades_on_another_rendezvous_backend():
    class Other:  # e.g. etcd's handler: none of the c10d handler's private state
        pass

    assert torch_compat.rendezvous_round(Other()) is None
    assert torch_compat.rendezvous_backend(Other()) is None
    assert torch_compat.this_node(Other()) is None and torch_compat.keep_alive_expiry(Other()) is None
    assert torch_compat.local_exit_codes(Other()) == {}
