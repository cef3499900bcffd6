"""`dtorch status RUN_DIR`: what the job last reported (the run directory's status.json), its
recent changes of state, and the last recovery `dtorch run` logged there.

    dtorch status runs/train            # state, step, tokens/s, checkpoint step, why it failed
    dtorch status runs/train --json
"""

from __future__ import annotations

import argparse
import json
import os

from dtorch.errors import ConfigError


def add_parser(sub, help_text: str) -> None:
    p = sub.add_parser("status", help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the run's directory (its checkpoint/log directory)")
    p.add_argument("--json", action="store_true", help="print status.json as it is")
    p.add_argument("--history", type=int, default=5, help="changes of state to show (default 5)")
    p.set_defaults(func=run)


def run(args) -> int:
    from dtorch.integrations import status

    if not os.path.isdir(args.run_dir):
        raise ConfigError("run_dir", args.run_dir, "no such directory; give the run's checkpoint directory")
    doc = status.read(args.run_dir)
    if args.json:
        print(json.dumps(doc))
        return 0 if doc is not None else 1
    print(status.format_status(doc, args.run_dir))
    hist = status.history(args.run_dir)
    if args.history > 0 and len(hist) > 1:
        print("recent changes:")
        for h in hist[-args.history:]:
            print(f"  {h.get('t', 0):.0f} {status.one_line(h)}")
    events = os.path.join(args.run_dir, "events.jsonl")
    if os.path.exists(events):
        last = None
        with open(events) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("kind") == "recovery":
                    last = e
        if last is not None:
            print(f"last recovery: {json.dumps({k: v for k, v in last.items() if k != 'kind'})}")
    return 0 if doc is not None else 1
