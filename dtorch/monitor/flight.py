"""Read torch's flight-recorder dumps and name the ranks whose collective sequences differ.

torch's flight recorder keeps, per process, a ring buffer of the last N collectives it issued
(`TORCH_FR_BUFFER_SIZE`, older name `TORCH_NCCL_TRACE_BUFFER_SIZE`; gloo and NCCL). A dump is a
dict: ``version``, ``pg_config`` (process group name -> its ranks), and ``entries``, one per
collective: ``process_group`` (name, description), ``collective_seq_id`` (the n-th collective on
that group), ``profiling_name`` (``nccl:all_reduce``, ``gloo:all_gather``), ``input_sizes``,
``state`` (scheduled / started / completed), ``is_p2p`` and, on NCCL with timing, ``duration_ms``.
It arrives here in any of the forms torch or DTorch writes:

- the pickle the NCCL watchdog writes on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) to
  ``TORCH_FR_DUMP_TEMP_FILE<rank>``, the same bytes as ``torch._C._distributed_c10d._dump_fr_trace()``;
- the JSON of ``_dump_fr_trace_json()``;
- DTorch's ``rank<R>.flight-recorder.json``, written by the heartbeat thread on a hang
  (`dtorch.elastic.heartbeat.write_dumps`: the last entries and the highest sequence number per
  group).

Every rank of a group must issue the same collectives in the same order: the n-th collective of
group g is the same op on the same sizes on all its ranks. `find_divergence` compares the ranks'
sequences per group and returns where they part: two ranks that issued *different* collectives
under one sequence number (a mismatch: both wait forever, or read garbage), or a rank that has not
issued the collective its peers did (it is stuck before it: the others wait for it).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

DTORCH_SUFFIX = ".flight-recorder.json"
_TRAILING_RANK = re.compile(r"(\d+)$")


class _Restricted(pickle.Unpickler):
    """Dumps hold only dicts, lists, tuples, strings and numbers: refuse anything else (a pickle
    can run code, and a run directory is not a trusted place)."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise pickle.UnpicklingError(f"flight-recorder dump refers to {module}.{name}; not a torch dump")


def load(path: str | os.PathLike) -> dict[str, Any]:
    """One dump file, pickle or JSON (see module doc), as a dict with at least ``entries``."""
    raw = Path(path).read_bytes()
    if raw[:1] == b"\x80":
        import io

        data = _Restricted(io.BytesIO(raw)).load()
    else:
        data = json.loads(raw.decode())
    if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
        raise ValueError(f"{path}: not a flight-recorder dump (no entries list)")
    data.setdefault("entries", [])
    return data


def dump_files(directory: str | os.PathLike) -> dict[int, str]:
    """rank -> dump file in `directory`: DTorch's ``rank<R>.flight-recorder.json`` or torch's
    ``<prefix><R>`` (a name ending in the rank, e.g. ``nccl_trace_rank_3``). DTorch's file wins
    when a rank has both (it is written at the hang, the watchdog's later)."""
    out: dict[int, str] = {}
    theirs: dict[int, str] = {}
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for n in names:
        p = os.path.join(directory, n)
        if n.startswith("rank") and n.endswith(DTORCH_SUFFIX):
            try:
                out[int(n[4:-len(DTORCH_SUFFIX)])] = p
            except ValueError:
                continue
        elif (m := _TRAILING_RANK.search(n)) and "." not in n:
            theirs[int(m.group(1))] = p
    for r, p in theirs.items():
        out.setdefault(r, p)
    return out


def _pg_key(e: dict[str, Any]) -> str:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return str(pg if pg is not None else e.get("pg_id"))


def _sizes(x: Any) -> Any:
    return json.loads(json.dumps(x)) if x is not None else None  # tuples -> lists: pickle and JSON compare equal


def sequences(dump: dict[str, Any]) -> tuple[dict[str, dict[int, tuple[str, Any]]], dict[str, int]]:
    """Per process group: collective sequence number -> (op, input sizes), for the collectives in
    the dump (point-to-point ops are left out: each pair has its own order); and the highest
    sequence number per group (from ``max_seq_by_pg`` where the dump carries it, else the entries)."""
    seqs: dict[str, dict[int, tuple[str, Any]]] = {}
    top: dict[str, int] = {str(k): int(v) for k, v in (dump.get("max_seq_by_pg") or {}).items()}
    for e in dump["entries"]:
        if e.get("is_p2p"):
            continue
        seq = e.get("collective_seq_id")
        if seq is None:
            continue
        pg = _pg_key(e)
        name = str(e.get("profiling_name") or "?")
        op = name.split(":", 1)[1] if ":" in name else name  # nccl:all_reduce and gloo:all_reduce are one op
        seqs.setdefault(pg, {})[int(seq)] = (op, _sizes(e.get("input_sizes")))
        top[pg] = max(top.get(pg, 0), int(seq))
    return seqs, top


def find_divergence(dumps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Where the ranks' collective sequences part (see module doc), or None when they agree.

    Returns ``kind`` ("mismatch": different collectives under one sequence number; "behind": one
    rank has not issued what its peers did), the process group ``pg``, the sequence number ``seq``,
    ``rank_a`` with ``call_a`` (op, sizes) and ``rank_b`` with ``call_b`` (None when behind). The
    lowest sequence number where ranks differ wins; a mismatch before a rank behind."""
    parsed = {r: sequences(d) for r, d in dumps.items()}
    groups = sorted({pg for s, _ in parsed.values() for pg in s} | {pg for _, t in parsed.values() for pg in t})
    found: list[tuple[int, int, dict[str, Any]]] = []
    for pg in groups:
        ranks = sorted(r for r, (s, t) in parsed.items() if pg in s or pg in t)
        if len(ranks) < 2:
            continue
        for i, ra in enumerate(ranks):
            sa, ta = parsed[ra][0].get(pg, {}), parsed[ra][1].get(pg, 0)
            for rb in ranks[i + 1:]:
                sb, tb = parsed[rb][0].get(pg, {}), parsed[rb][1].get(pg, 0)
                for seq in sorted(set(sa) & set(sb)):
                    if sa[seq] != sb[seq]:
                        found.append((seq, 0, {"kind": "mismatch", "pg": pg, "seq": seq, "rank_a": ra,
                                               "call_a": list(sa[seq]), "rank_b": rb, "call_b": list(sb[seq])}))
                        break
                if ta != tb:
                    (hi, shi, thi), (lo, tlo) = ((ra, sa, ta), (rb, tb)) if ta > tb else ((rb, sb, tb), (ra, ta))
                    call = shi.get(tlo + 1)
                    found.append((tlo + 1, 1, {"kind": "behind", "pg": pg, "seq": tlo + 1, "rank_a": hi,
                                               "call_a": list(call) if call else None, "rank_b": lo,
                                               "call_b": None, "issued_a": thi, "issued_b": tlo}))
    if not found:
        return None
    return min(found, key=lambda f: (f[1], f[0], f[2]["rank_a"], f[2]["rank_b"]))[2]


def find_divergence_in(*directories: str | os.PathLike | None) -> dict[str, Any] | None:
    """`find_divergence` over the dumps found in `directories` (later directories only add ranks
    the earlier ones lack). Unreadable files are skipped."""
    dumps: dict[int, dict[str, Any]] = {}
    for d in directories:
        if not d:
            continue
        for r, p in dump_files(d).items():
            if r in dumps:
                continue
            try:
                dumps[r] = load(p)
            except (OSError, ValueError, pickle.UnpicklingError, EOFError, UnicodeDecodeError):
                continue
    return find_divergence(dumps) if len(dumps) > 1 else None


def describe(m: dict[str, Any]) -> str:
    def call(c: list | None) -> str:
        if not c:
            return "?"
        sizes = f" {c[1]}" if c[1] else ""
        return f"{c[0]}{sizes}"

    where = f"process group {m['pg']}, collective #{m['seq']}"
    if m["kind"] == "mismatch":
        return (f"collective sequences differ ({where}): rank {m['rank_a']} issued {call(m['call_a'])}, rank "
                f"{m['rank_b']} issued {call(m['call_b'])}")
    return (f"collective sequences differ ({where}): rank {m['rank_a']} issued {call(m['call_a'])}, rank "
            f"{m['rank_b']} never did (it issued {m['issued_b']} on that group, rank {m['rank_a']} {m['issued_a']})")
