"""`dtorch report RUN_DIR`: an HTML report and PNG plots of a run, finished or crashed.

Reads `RUN_DIR/metrics.jsonl` (step records, and the ``plan``, ``ranks``, ``checkpoint``,
``straggler`` ... events), `RUN_DIR/oom.jsonl` (out-of-memory records of every rank) and, when
there is one, the elastic event log
(`RUN_DIR/events.jsonl` or `--events PATH`: failures, recoveries, phases). Torn or partial lines (a
process killed mid-write) are skipped, so a run that crashed reports what it got to.

Writes into `RUN_DIR/report/` (or `--out`): index.html, loss.png, throughput.png, ranks.png
(per-rank step terms), predicted.png (predicted vs measured per term), timeline.png (events).
"""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError
from dtorch.monitor.comms import describe_mismatch, find_mismatch
from dtorch.monitor.jsonl import read_jsonl
from dtorch.monitor.oom import message as oom_message
from dtorch.monitor.ranks import own_work

COLORS = {"data": "#8d6e63", "compute": "#1e88e5", "comm_dp_replicate": "#43a047", "comm_dp_shard": "#7cb342",
          "comm_tp": "#e53935", "comm_cp": "#fb8c00", "comm_pp": "#8e24aa", "comm_other": "#9e9e9e",
          "optimizer": "#fdd835", "other": "#cfd8dc"}


def load_run(run_dir: str | Path, events: str | Path | None = None) -> dict[str, Any]:
    """The run's records, split: steps, ranks windows, other events, and the elastic event log."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError("run_dir", str(run_dir), "give the directory holding metrics.jsonl (the checkpoint "
                          "or log directory of the run)")
    recs = read_jsonl(run / "metrics.jsonl")
    ev_path = Path(events) if events else run / "events.jsonl"
    if not recs and not ev_path.exists():
        raise ConfigError("run_dir", str(run_dir), "it has no metrics.jsonl or events.jsonl: is this the run's "
                          "log directory?")
    steps = [r for r in recs if "event" not in r and "step" in r and "loss" in r]
    ranks = [r for r in recs if r.get("event") == "ranks" and r.get("ranks")]
    others = [r for r in recs if "event" in r and r.get("event") != "ranks"]
    return {"steps": steps, "ranks": ranks, "events": others, "run_events": read_jsonl(ev_path),
            "ooms": read_jsonl(run / "oom.jsonl"), "run_dir": str(run)}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Figures of the report: progress, throughput, per-rank means, stragglers, predicted vs measured."""
    steps, ranks, events = run["steps"], run["ranks"], run["events"]
    plan = next((e for e in reversed(events) if e.get("event") == "plan"), None)
    out: dict[str, Any] = {"steps_logged": len(steps), "last_step": steps[-1]["step"] if steps else None,
                           "final_loss": steps[-1]["loss"] if steps else None,
                           "plan": plan.get("plan") if plan else None, "family": plan.get("family") if plan else None}
    if steps:
        body = steps[3:] or steps  # the first steps carry one-time work
        out["median_step_time_s"] = statistics.median(s["step_time_s"] for s in body)
        out["median_tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in body)
        out["median_mfu"] = statistics.median(s["mfu"] for s in body)
    finished = any(e.get("event") == "feedback" for e in events) or any(
        e.get("kind") == "job_succeeded" for e in run["run_events"])
    out["finished"] = finished
    if ranks:
        windows = ranks[1:] or ranks  # the first window includes warm-up
        world = len(windows[-1]["ranks"])
        terms = windows[-1]["terms"]
        per_rank = []
        for r in range(world):
            rows = [w["ranks"][r] for w in windows if len(w["ranks"]) == world]
            mean = {t: statistics.fmean((x.get(t) or 0.0) for x in rows)
                    for t in (*terms, "step", "own_ratio", "fwd_blocks")}
            mean["mem_peak_bytes"] = max((x.get("mem_peak_bytes") or 0) for x in rows)
            per_rank.append({"rank": r, **mean})
        own = [own_work(p) for p in per_rank]
        slowest = max(range(world), key=lambda i: own[i])
        out["world"] = world
        out["terms"] = terms
        out["per_rank"] = per_rank
        out["slowest_rank"] = slowest
        out["slowest_ratio"] = own[slowest] / max(min(own), 1e-12)
        # named as the live view names them: flagged in two windows in a row (the first window
        # excluded), or by an event; most often flagged first
        flagged: dict[int, int] = {}
        for prev, cur in zip(windows, windows[1:]):
            for r in set(prev.get("stragglers", [])) & set(cur.get("stragglers", [])):
                flagged[r] = flagged.get(r, 0) + 1
        for e in events:
            if e.get("event") in ("straggler", "slow_rank"):
                for r in e.get("ranks", []):
                    flagged.setdefault(r, 0)
        out["stragglers"] = sorted(flagged, key=lambda r: (-flagged[r], r))
        out["straggler_windows"] = {str(r): n for r, n in flagged.items()}
        pred = windows[-1].get("predicted") or {}
        out["predicted_vs_measured"] = [
            {"term": k, "predicted_s": v,
             "measured_s": statistics.fmean(w["mean"].get(k, 0.0) for w in windows)} for k, v in pred.items()]
    out["ooms"] = run.get("ooms") or [e for e in run["run_events"] if e.get("kind") == "oom"]
    out["failures"] = [e for e in run["run_events"] if "fail" in str(e.get("kind", ""))]
    mismatch = find_mismatch(run["run_dir"])
    out["comm_mismatch"] = mismatch
    if mismatch is not None:
        out["comm_mismatch_text"] = describe_mismatch(mismatch)
    return out


def _plots(run: dict[str, Any], s: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    steps = run["steps"]
    if steps:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot([x["step"] for x in steps], [x["loss"] for x in steps], color="#d84315", lw=1.2)
        ax.set(xlabel="step", ylabel="loss", title="loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=110)
        plt.close(fig)
        made.append("loss.png")
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot([x["step"] for x in steps], [x["tokens_per_s"] for x in steps], color="#1565c0", lw=1.0)
        ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
        ax2 = ax.twinx()
        ax2.plot([x["step"] for x in steps], [100 * x["mfu"] for x in steps], color="#2e7d32", lw=0.8, alpha=0.6)
        ax2.set_ylabel("MFU %", color="#2e7d32")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=110)
        plt.close(fig)
        made.append("throughput.png")
    if s.get("per_rank"):
        pr, terms = s["per_rank"], [t for t in s["terms"] if any(p[t] > 0 for p in s["per_rank"])]
        fig, ax = plt.subplots(figsize=(8.5, 1.4 + 0.45 * len(pr)))
        left = [0.0] * len(pr)
        for t in terms:
            vals = [p[t] * 1e3 for p in pr]
            ax.barh([f"rank {p['rank']}" for p in pr], vals, left=left, color=COLORS.get(t, None), label=t)
            left = [a + b for a, b in zip(left, vals)]
        for i in s.get("stragglers", []):
            ax.annotate("straggler", (left[i], i), xytext=(4, -3), textcoords="offset points", color="#c62828")
        ax.invert_yaxis()
        ax.set(xlabel="ms per step (mean over windows)", title="per-rank step terms")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        fig.savefig(out / "ranks.png", dpi=110)
        plt.close(fig)
        made.append("ranks.png")
    if s.get("predicted_vs_measured"):
        pm = s["predicted_vs_measured"]
        fig, ax = plt.subplots(figsize=(7, 3.2))
        xs = range(len(pm))
        ax.bar([x - 0.2 for x in xs], [p["predicted_s"] * 1e3 for p in pm], width=0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [p["measured_s"] * 1e3 for p in pm], width=0.4, label="measured")
        ax.set_xticks(list(xs), [p["term"] for p in pm], rotation=20, fontsize=8)
        ax.set(ylabel="ms per step", title="predicted vs measured (mean over ranks)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "predicted.png", dpi=110)
        plt.close(fig)
        made.append("predicted.png")
    marks = [(e["t"], e.get("event") or e.get("kind")) for e in run["events"] + run["run_events"]
             if isinstance(e.get("t"), (int, float)) and (e.get("event") or e.get("kind")) not in ("phase",)]
    prog = [(w["wall"], w["step"]) for w in run["ranks"] if "wall" in w]
    if marks or prog:
        t0 = min([m[0] for m in marks] + [p[0] for p in prog])
        fig, ax = plt.subplots(figsize=(7, 3.2))
        if prog:
            ax.plot([p[0] - t0 for p in prog], [p[1] for p in prog], color="#555", lw=1, label="step")
        kinds = sorted({k for _, k in marks})
        ymax = max([p[1] for p in prog] or [1])
        for i, k in enumerate(kinds):
            ts = [m[0] - t0 for m in marks if m[1] == k]
            ax.scatter(ts, [ymax * (0.1 + 0.8 * (i + 0.5) / max(len(kinds), 1))] * len(ts), s=18, label=k,
                       marker="v" if "fail" in k or "oom" in k else "o")
        ax.set(xlabel="seconds since the first record", ylabel="step", title="timeline")
        ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        fig.savefig(out / "timeline.png", dpi=110)
        plt.close(fig)
        made.append("timeline.png")
    return made


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, events: str | Path | None = None) -> Path:
    """Write the report; returns the path of index.html."""
    run = load_run(run_dir, events)
    s = summarize(run)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(run, s, out)
    e = html.escape
    rows = [("plan", f"{s.get('family') or '-'}: {s.get('plan') or '-'}"),
            ("status", "finished" if s["finished"] else "did not finish (crashed, stopped or still running)"),
            ("last step logged", s["last_step"]), ("final loss", s["final_loss"]),
            ("median step", f"{_ms(s.get('median_step_time_s'))} ms"),
            ("median tokens/s", f"{s.get('median_tokens_per_s', 0):,.0f}"),
            ("median MFU", f"{100 * s.get('median_mfu', 0):.1f} %")]
    if "slowest_rank" in s:
        rows.append(("slowest rank", f"rank {s['slowest_rank']}: its own work (data, compute, optimizer; "
                                     f"waits excluded) is {s['slowest_ratio']:.2f}x the fastest rank's"))
        rows.append(("stragglers named", ", ".join(f"rank {r}" for r in s["stragglers"]) or "none"))
    parts = ["<!doctype html><meta charset=utf-8><title>DTorch run report</title>",
             "<style>body{font:14px system-ui,sans-serif;margin:20px;max-width:1100px}"
             "td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}table{border-collapse:collapse}"
             "img{max-width:100%;border:1px solid #eee;margin:6px 0}</style>",
             f"<h1>Run report: {e(str(run_dir))}</h1><table>"]
    parts += [f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in rows]
    parts.append("</table>")
    if s.get("per_rank"):
        terms = [t for t in s["terms"] if any(p[t] > 0 for p in s["per_rank"])]
        parts.append("<h2>Per rank (ms per step, mean over windows)</h2><table><tr><th>rank</th>"
                     + "".join(f"<th>{e(t)}</th>" for t in terms) + "<th>step</th><th>peak MiB</th><th></th></tr>")
        for p in s["per_rank"]:
            flag = "STRAGGLER" if p["rank"] in s["stragglers"] else ("slowest" if p["rank"] == s["slowest_rank"] else "")
            parts.append(f"<tr><td>{p['rank']}</td>" + "".join(f"<td>{_ms(p[t])}</td>" for t in terms)
                         + f"<td>{_ms(p['step'])}</td><td>{p['mem_peak_bytes'] / 2**20:,.0f}</td><td>{flag}</td></tr>")
        parts.append("</table>")
    if s.get("predicted_vs_measured"):
        parts.append("<h2>Predicted vs measured</h2><table><tr><th>term</th><th>predicted ms</th><th>measured ms</th>"
                     "<th>ratio</th></tr>")
        for p in s["predicted_vs_measured"]:
            ratio = p["measured_s"] / p["predicted_s"] if p["predicted_s"] else float("nan")
            parts.append(f"<tr><td>{e(p['term'])}</td><td>{_ms(p['predicted_s'])}</td><td>{_ms(p['measured_s'])}</td>"
                         f"<td>{ratio:.2f}x</td></tr>")
        parts.append("</table>")
    if s.get("comm_mismatch_text"):
        parts.append(f"<h2>Communication</h2><p><b>HANG CAUSE:</b> {e(s['comm_mismatch_text'])}</p>")
    if s["ooms"]:
        parts.append("<h2>Out of memory</h2><ul>")
        for o in s["ooms"]:
            try:
                text = oom_message(o)
            except (KeyError, TypeError):
                text = json.dumps(o, default=str)
            parts.append(f"<li>{e(text)}<br><code>{e(json.dumps(o.get('measured'), default=str))}</code></li>")
        parts.append("</ul>")
    parts += [f"<h2>{e(img[:-4])}</h2><img src='{img}' alt='{img}'>" for img in images]
    notable = [x for x in run["events"] if x.get("event") not in ("plan",)] + [
        x for x in run["run_events"] if x.get("kind") != "phase"]
    parts.append("<h2>Events</h2><ul>" + "".join(
        f"<li><code>{e(json.dumps(x, default=str)[:300])}</code></li>" for x in notable[-300:]) + "</ul>")
    index = out / "index.html"
    index.write_text("\n".join(parts))
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    return index
