"""`dtorch report RUN_DIR`: an HTML report with PNG plots of a run (finished or crashed).

    dtorch report runs/train                         # writes runs/train/report/index.html
    dtorch report runs/train --events /tmp/dtorch-job7/events.jsonl --out /tmp/rep
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("report", help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the run's log directory (holds metrics.jsonl; the checkpoint dir by default)")
    p.add_argument("--events", default=None,
                   help="the elastic event log (default RUN_DIR/events.jsonl; `dtorch run --run-dir` sets it)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dtorch.monitor.report import load_run, summarize, write_report

    index = write_report(args.run_dir, args.out, args.events)
    s = summarize(load_run(args.run_dir, args.events))
    line = f"dtorch report: {index} (last step {s['last_step']}, {'finished' if s['finished'] else 'not finished'}"
    if "slowest_rank" in s:
        line += f"; slowest rank {s['slowest_rank']} at {s['slowest_ratio']:.2f}x"
        if s["stragglers"]:
            line += "; stragglers: " + ", ".join(f"rank {r}" for r in s["stragglers"])
    print(line + ")")
    if s.get("comm_mismatch_text"):
        print("dtorch report: " + s["comm_mismatch_text"])
    return 0
