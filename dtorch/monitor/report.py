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
    if not events and not ev_path.exists():  # the launcher's run directory, as the run recorded it
        logged = [r["path"] for r in recs if r.get("event") == "events_log" and r.get("path")]
        if logged:
            ev_path = Path(logged[-1])
    if not recs and not ev_path.exists():
        raise ConfigError("run_dir", str(run_dir), "it has no metrics.jsonl or events.jsonl: is this the run's "
                          "log directory?")
    steps = [r for r in recs if "event" not in r and "step" in r and "loss" in r]
    ranks = [r for r in recs if r.get("event") == "ranks" and r.get("ranks")]
    others = [r for r in recs if "event" in r and r.get("event") != "ranks"]
    return {"steps": steps, "ranks": ranks, "events": others, "run_events": read_jsonl(ev_path),
            "ooms": read_jsonl(run / "oom.jsonl"), "run_dir": str(run)}


FAILURE_KINDS = ("detected", "stopped", "hang", "fatal", "worker_error", "oom")
"""Event-log kinds that record a failure (the agent's detections, a fatal error, an OOM)."""


def event_kind(e: dict[str, Any]) -> str:
    return str(e.get("event") or e.get("kind") or "?")


def event_class(e: dict[str, Any]) -> str:
    """failure, recovery, checkpoint, plan, or "" for the rest."""
    k = event_kind(e)
    if k == "fault":
        return "fault"  # a chaos drill's injection: the failure it causes is recorded as detected
    if k in FAILURE_KINDS or "fail" in k:
        return "failure"
    if k in ("recovery", "resume", "snapshot_restore"):
        return "recovery"
    return k if k in ("checkpoint", "plan") else ""


def describe_event(e: dict[str, Any]) -> str:
    """One line in words for an event record of metrics.jsonl or the event log."""
    k = event_kind(e)
    ranks = e.get("ranks")
    who = f" rank(s) {', '.join(map(str, ranks))}" if isinstance(ranks, list) else (
        f" rank {e['rank']}" if e.get("rank") is not None else "")
    if k == "plan":
        return f"plan {e.get('plan')} ({e.get('family') or '?'}, from {e.get('source') or '?'})"
    if k == "checkpoint":
        return f"checkpoint of step {e.get('step')}"
    if k == "eval":
        return f"eval at step {e.get('step')}: loss {e.get('loss')}, perplexity {e.get('perplexity')}"
    if k == "resume":
        return f"resumed at step {e.get('step')}"
    if k == "recovery":
        who = f" node(s) {e['nodes']}" if e.get("nodes") else who
        total = f" in {e['total']:.2f} s" if isinstance(e.get("total"), (int, float)) else ""
        return f"recovered from {e.get('cause') or 'a failure'} of{who}{total} at world size {e.get('world_size')}"
    if k in ("detected", "stopped", "observed"):
        return (f"{'failure' if k != 'observed' else 'observed'}: {e.get('cause') or '?'} of{who}"
                + (f" ({e['why']})" if e.get("why") else "") + ("; the job stopped" if k == "stopped" else ""))
    if k == "fault":
        return f"injected fault {e.get('fault') or '?'}"
    if k == "oom":
        return f"out of memory on rank {e.get('rank')} in {e.get('phase') or '?'} at step {e.get('step')}"
    rest = {x: v for x, v in e.items() if x not in ("kind", "event", "t", "time_s", "wall", "pid")}
    return f"{k}: " + " ".join(f"{x}={v}" for x, v in list(rest.items())[:6])


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Figures of the report: progress, throughput, per-rank means, stragglers, predicted vs measured."""
    steps, ranks, events = run["steps"], run["ranks"], run["events"]
    plan = next((e for e in reversed(events) if e.get("event") == "plan"), None)
    last_eval = next((e for e in reversed(events) if e.get("event") == "eval"), None)
    out: dict[str, Any] = {"steps_logged": len(steps), "last_step": steps[-1]["step"] if steps else None,
                           "final_loss": steps[-1]["loss"] if steps else None,
                           "plan": plan.get("plan") if plan else None, "family": plan.get("family") if plan else None,
                           "final_eval_loss": last_eval.get("loss") if last_eval else None,
                           "final_eval_perplexity": last_eval.get("perplexity") if last_eval else None,
                           "final_eval_step": last_eval.get("step") if last_eval else None}
    if steps:
        body = steps[3:] or steps  # the first steps carry one-time work
        out["median_step_time_s"] = statistics.median(s["step_time_s"] for s in body)
        out["median_tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in body)
        out["median_mfu"] = statistics.median(s["mfu"] for s in body)
    if plan:  # MFU's denominator and the plan's figures, as the run logged them (dtorch.cluster.peak)
        out.update({k: plan.get(k) for k in ("predicted_mfu", "mfu_peak_flops", "flops_per_token", "world_size",
                                             "predicted_memory_breakdown")})
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
    out["failures"] = [e for e in run["run_events"] if event_class(e) == "failure"]
    out["recoveries"] = [e for e in run["run_events"] if event_class(e) == "recovery"]
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
        ax.plot([x["step"] for x in steps], [x["loss"] for x in steps], color="#d84315", lw=1.2, label="train")
        evals = [e for e in run["events"] if e.get("event") == "eval"]
        if evals:
            ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], color="#1565c0", lw=1.2, marker="o",
                    ms=3, label="eval")
            ax.legend(fontsize=8)
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
    marks = [(e["t"], event_kind(e), event_class(e)) for e in run["events"] + run["run_events"]
             if isinstance(e.get("t"), (int, float)) and event_kind(e) not in ("phase", "events_log", "eval")]
    prog = [(w["wall"], w["step"]) for w in run["ranks"] if "wall" in w]
    if marks or prog:
        t0 = min([m[0] for m in marks] + [p[0] for p in prog])
        kinds = sorted({m[1] for m in marks}, key=lambda k: (k not in (*FAILURE_KINDS, "fault", "recovery"), k))
        fig, ax = plt.subplots(figsize=(8, 1.6 + 0.32 * max(len(kinds), 1)))
        colour = {"failure": "#c62828", "fault": "#e57373", "recovery": "#2e7d32", "checkpoint": "#757575",
                  "plan": "#1565c0"}
        for lane, k in enumerate(kinds):  # one lane per kind: the y axis names it
            ms = [m for m in marks if m[1] == k]
            ax.scatter([m[0] - t0 for m in ms], [lane] * len(ms), s=22, color=colour.get(ms[0][2], "#8d6e63"),
                       marker="v" if ms[0][2] in ("failure", "fault") else "o", zorder=3)
        for m in marks:  # failures and recoveries across every lane
            if m[2] in ("failure", "recovery"):
                ax.axvline(m[0] - t0, color=colour[m[2]], lw=0.8, alpha=0.5)
        ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
        ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
        ax.set(xlabel="seconds since the first record", title="timeline (events by kind; grey: steps done)")
        ax.grid(axis="x", alpha=0.3)
        if prog:
            ax2 = ax.twinx()
            ax2.plot([p[0] - t0 for p in prog], [p[1] for p in prog], color="#9e9e9e", lw=1)
            ax2.set_ylabel("step", color="#757575")
        fig.tight_layout()
        fig.savefig(out / "timeline.png", dpi=110)
        plt.close(fig)
        made.append("timeline.png")
    return made


def _clock(t: Any) -> str:
    import datetime

    if not isinstance(t, (int, float)):
        return ""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def mfu_line(s: dict[str, Any]) -> str:
    """'12.8 % (plan: 9.9 %), model FLOPs (6N + attention, no recompute) x tokens/s over 2 x 166.4
    GFLOP/s': the measured median, the plan's prediction and the one denominator both use."""
    line = f"{100 * s.get('median_mfu', 0):.1f} %"
    if s.get("predicted_mfu") is not None:
        line += f" (plan: {100 * s['predicted_mfu']:.1f} %)"
    if s.get("mfu_peak_flops"):
        line += (f", model FLOPs (6N + attention, no recompute) x tokens/s over {s.get('world_size') or 1} x "
                 f"{s['mfu_peak_flops'] / 1e9:,.1f} GFLOP/s peak")
    return line


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, events: str | Path | None = None) -> Path:
    """Write the report; returns the path of index.html."""
    run = load_run(run_dir, events)
    s = summarize(run)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(run, s, out)
    e = html.escape
    rows = [("plan", f"{s.get('family') or '-'}: {s.get('plan') or '-'}"),
            ("status", ("finished" if s["finished"] else "did not finish (crashed, stopped or still running)")
             + f"; {len(s['failures'])} failure(s), {len(s['recoveries'])} recovery(ies)"),
            ("last step logged", s["last_step"]), ("final loss", s["final_loss"]),
            *([("final eval loss", f"{s['final_eval_loss']:.4f} (perplexity {s['final_eval_perplexity']:.2f}, "
                                   f"step {s['final_eval_step']})")] if s.get("final_eval_loss") is not None else []),
            ("median step", f"{_ms(s.get('median_step_time_s'))} ms"),
            ("median tokens/s", f"{s.get('median_tokens_per_s', 0):,.0f}"),
            ("median MFU", mfu_line(s))]
    if s.get("predicted_memory_breakdown"):
        from dtorch.plan.explain import memory_summary

        rows.append(("predicted memory per rank", memory_summary(s["predicted_memory_breakdown"])))
    if "slowest_rank" in s:
        rows.append(("slowest rank", f"rank {s['slowest_rank']}: its own work (data, compute, optimizer; "
                                     f"waits excluded) is {s['slowest_ratio']:.2f}x the fastest rank's"))
        rows.append(("stragglers named", ", ".join(f"rank {r}" for r in s["stragglers"]) or "none"))
    parts = ["<!doctype html><meta charset=utf-8><title>DTorch run report</title>",
             "<style>body{font:14px system-ui,sans-serif;margin:20px;max-width:1100px}"
             "td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}table{border-collapse:collapse}"
             "img{max-width:100%;border:1px solid #eee;margin:6px 0}"
             "tr.failure td,tr.fault td{background:#fdecea}tr.recovery td{background:#e8f5e9}</style>",
             f"<h1>Run report: {e(str(run_dir))}</h1><table>"]
    parts += [f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in rows]
    parts.append("</table>")
    if s["failures"] or s["recoveries"]:
        parts.append("<h2>Failures and recoveries</h2><table><tr><th>time</th><th>kind</th><th>what</th></tr>")
        for x in sorted([x for x in run["run_events"] if event_class(x) in ("failure", "fault", "recovery")], key=lambda x: x.get("t") or 0):
            parts.append(f"<tr class='{event_class(x)}'><td>{_clock(x.get('t'))}</td><td>{e(event_kind(x))}</td>"
                         f"<td>{e(describe_event(x))}</td></tr>")
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
    notable = sorted([x for x in run["events"] + run["run_events"] if event_kind(x) not in ("phase", "events_log")],
                     key=lambda x: x.get("t") or 0)
    parts.append("<h2>Events</h2><table><tr><th>time</th><th>kind</th><th>what</th></tr>" + "".join(
        f"<tr class='{event_class(x)}'><td>{_clock(x.get('t'))}</td><td>{e(event_kind(x))}</td>"
        f"<td>{e(describe_event(x)[:300])}</td></tr>" for x in notable[-300:]) + "</table>")
    index = out / "index.html"
    index.write_text("\n".join(parts))
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    return index
