"""Every command in README.md and docs/*.md runs as written, on a fresh clone.

What is a command (the rule the docs follow):
- every line of a fenced block tagged `bash`, `sh` or `shell` (a trailing backslash continues it;
  blank lines and `#` comment lines are not commands);
- in a block tagged `console`, a line starting with `$ `; the lines after it are its output as
  shown. When that output starts with `dtorch ...: error: FIELD=...:`, the command must exit 2
  and print that line up to the field's value;
- an untagged or `text` block is output or a file's contents and is never run: one that starts
  with a command (`$ `, `dtorch `, `.venv/bin/`, `python -m`, `bash `) fails this test, so a
  command cannot hide from it by leaving its block untagged.

A doc marks a command this test must skip with an HTML comment (not shown when rendered) before it
in the same file, naming the start of the command (whole words, after `.venv/bin/`) and the reason:

    <!-- doc-test skip: dtorch probe --nproc 2,4 -- spawns 6 ranks for minutes -->

A marker that matches no command fails the test. Keep them few: a GPU, the network or the whole
suite. A command that runs here but takes long (a 4-rank probe, a launch as two nodes, a benchmark)
is marked `<!-- doc-test long: PREFIX -- reason -->` instead: it runs in
`test_the_long_commands_run_as_written`, a multi-process test `scripts/test.sh` runs in its front
session, not in its doc's own test.

How they run: each doc in its own empty directory (its `runs/train` stays there for the doc's
next command, as for a reader following it; `benchmarks/` and `examples/` copied in when a command
names them), with the calibration store, the caches and HOME in that directory, never the user's.
`dtorch ...` runs in this process through `dtorch.cli.main` (the console script calls the same
function; it saves the interpreter's start and torch's import per command; a `dtorch plan` or
`submit slurm` another doc already ran, which writes no file, is not run again; a `PYTHONPATH=DIR`
before it puts DIR first on sys.path for the call), except a command that starts worker processes
(`dtorch run`, `dtorch probe` but `--disk`, a drill, `dtorch train --nproc N`): `python -m dtorch.cli`
in a subprocess, as the console script would, and for a launch across machines one per node, at
once. `python -m ...` runs in a subprocess with the checkout on PYTHONPATH (in this process for
`IN_PROCESS_MODULES`), anything else with shell syntax (`&&`, `|`, `$(...)`)
through bash; a `$(...)` in the VAR=value assignments before a command is expanded by bash first,
so the command after them is still read as one. Before running, `SUBSTITUTIONS` below shrinks
what a doc names at full size (`MODULE_SUBSTITUTIONS` a `python -m` module's arguments) and
`ASSIGNMENTS` replaces what only the reader's machine has, each rule with its reason; the inputs
a reader brings (a Hugging Face model directory, a corpus) are made tiny by `_inputs`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_LANGS = {"bash", "sh", "shell"}
COMMAND_START = re.compile(r"^(\$ |dtorch [\w-]+(\s|$)|\.venv/bin/|python -m |bash )")
SKIP = re.compile(r"<!--\s*doc-test (skip|long):\s*(.+?)\s+--\s+(.+?)\s*-->", re.S)
ERROR_LINE = re.compile(r"^(dtorch(?: [\w-]+)?: error: [\w.-]+=)")

TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=512,seq=128"
DRILL_STEP = 4  # a drill's fault strikes by this step
VERIFY_MODEL = "llama:layers=4,hidden=256,heads=8,kv_heads=8,vocab=512"

@dataclass
class Command:
    doc: str
    line: int
    text: str  # as written, continuation lines joined
    expect_code: int = 0
    expect_err: str | None = None  # the start of the error line a console block shows
    skip: str | None = None
    long: str | None = None  # runs, in test_the_long_commands_run_as_written (the marker's reason)


def _blocks(text: str):
    """(line of the opening fence, language, body) of every fenced block, at any indentation."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        yield i + 1, m.group(1).lower(), "\n".join(lines[i + 1:j])
        i = j + 1


def _joined(body: str) -> list[tuple[int, str]]:
    out, cur, start = [], "", 0
    for i, raw in enumerate(body.splitlines()):
        line = raw.strip()
        if not cur:
            start = i
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        out.append((start, cur.strip()))
        cur = ""
    return out


def commands(path: Path) -> tuple[list[Command], list[str]]:
    """The commands of a doc (with its skip markers applied) and the problems found: untagged
    blocks that hold commands, markers that match nothing."""
    text = path.read_text()
    name = str(path.relative_to(REPO))
    found: list[Command] = []
    problems: list[str] = []
    for line, lang, body in _blocks(text):
        first = next((s.strip() for s in body.splitlines() if s.strip()), "")
        if lang in ("", "text") and COMMAND_START.match(first):
            problems.append(f"{name}:{line}: a block of commands without a language: tag it bash (or console "
                            "with $ before each command)")
        if lang in RUN_LANGS:
            for i, cmd in _joined(body):
                if cmd and not cmd.startswith("#"):
                    found.append(Command(name, line + 1 + i, cmd))
        elif lang == "console":
            rows = body.splitlines()
            for i, row in enumerate(rows):
                if row.startswith("$ "):
                    typed, j = row[2:].strip(), i
                    while typed.endswith("\\") and j + 1 < len(rows):  # continued on the next line
                        j += 1
                        typed = typed[:-1] + " " + rows[j].strip()
                    cmd = Command(name, line + 1 + i, typed)
                    after = rows[j + 1].strip() if j + 1 < len(rows) else ""
                    m = ERROR_LINE.match(after)
                    if m:
                        cmd.expect_code, cmd.expect_err = 2, m.group(1)
                    found.append(cmd)
    for m in SKIP.finditer(text):
        kind, prefix, reason = m.group(1), " ".join(m.group(2).split()), " ".join(m.group(3).split())
        at = text[:m.start()].count("\n") + 1
        hits = [c for c in found if c.line > at and re.match(re.escape(prefix) + r"(\s|$)", _bare(c.text))]
        if not hits:
            problems.append(f"{name}:{at}: the {kind} marker for {prefix!r} matches no command after it")
        for c in hits:
            setattr(c, kind, reason)
    return found, problems


def _bare(cmd: str) -> str:
    return cmd.removeprefix(".venv/bin/")


# ---- what the docs name at full size, shrunk: (applies to, change, why) ----

def _set(argv: list[str], flag: str, value: str, *, cap: int | None = None) -> None:
    """Set `flag` to `value` (or, with `cap`, to the smaller of the given value and cap)."""
    if flag in argv:
        i = argv.index(flag)
        argv[i + 1] = str(min(int(argv[i + 1]), cap)) if cap is not None else value
    else:
        argv += [flag, value]


def _train(argv: list[str]) -> None:
    if "--print-config" in argv:
        return  # writes the configuration only: as written
    drill = "--chaos" in argv
    if drill:  # the fault strikes by step 4, and the run goes on 4 steps past it
        i = argv.index("--chaos") + 1
        argv[i] = _drill_spec(argv[i])
        _set(argv, "--steps", str(DRILL_STEP + 4))
        _set(argv, "--checkpoint-every", "2", cap=2)  # a checkpoint's phase comes by the fault's step
    else:
        _set(argv, "--steps", "2", cap=2)
    _set(argv, "--global-batch", "4", cap=4)
    _set(argv, "--seq-len", "32", cap=32)
    _set(argv, "--warmup", "1", cap=1)
    for flag, value in (("--nproc", None if drill else "1"), ("--sample-tokens", "4"), ("--no-progress", "")):
        if flag not in argv and value is not None:
            argv += [flag] + ([value] if value else [])
    if "--monitor-port" in argv:
        _set(argv, "--monitor-port", "0")


def _drill_spec(spec: str) -> str:
    """A --chaos spec whose faults strike by step DRILL_STEP (`step=N` and `every=N` at most that)."""
    return re.sub(r"\b(step|every)=(\d+)", lambda m: f"{m.group(1)}={min(int(m.group(2)), DRILL_STEP)}", spec)


def _script_drill(argv: list[str]) -> None:
    """`dtorch run ... examples/train.py`: the fault by step DRILL_STEP, the script to 2 steps past it."""
    if "--chaos" in argv:
        i = argv.index("--chaos") + 1
        argv[i] = _drill_spec(argv[i])
    script = argv.index("examples/train.py")
    if "--steps" not in argv[script:]:
        argv[script + 1:script + 1] = ["--steps", str(DRILL_STEP + 2)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machines(argv: list[str]) -> None:
    """A launch across machines, on this one: every host 127.0.0.1, the port a free one, and the
    nodes this machine starts (`_nodes`: the fewest the launch runs with) 2 workers between them."""
    for flag in ("--master-addr", "--master-port", "--rdzv-endpoint"):
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = {"--master-addr": "127.0.0.1", "--master-port": str(_free_port()),
                       "--rdzv-endpoint": f"127.0.0.1:{_free_port()}"}[flag]
    _set(argv, "--nproc-per-node", "1", cap=max(1, 2 // _min_nodes(argv)))


def _min_nodes(argv: list[str]) -> int:
    return int(argv[argv.index("--nnodes") + 1].split(":")[0]) if "--nnodes" in argv else 1


def _nodes(argv: list[str]) -> list[list[str]]:
    """The agents to start on this machine for a `dtorch run`: the command itself, and for a static
    launch given as node 0 of N (`--node-rank 0`, the doc saying what the others run) nodes 1..N-1
    too, the same command with their --node-rank."""
    if argv[:1] != ["run"] or "--node-rank" not in argv:
        return [argv]
    i = argv.index("--node-rank") + 1
    return [argv[:i] + [str(r)] + argv[i + 1:] for r in range(_min_nodes(argv))]


def _verify(argv: list[str]) -> None:
    argv[argv.index("--model") + 1] = VERIFY_MODEL


def _probe(argv: list[str]) -> None:
    if "--disk" in argv:
        _set(argv, "--disk-bytes", str(256 * 2**20), cap=256 * 2**20)
    elif "--quick" not in argv:
        argv.append("--quick")


SUBSTITUTIONS = [
    (lambda a: a[:1] == ["train"], _train,
     "training: 2 steps of at most 4 x 32 tokens (1 warm-up step), one process in this one (--nproc 1), 4 "
     "sampled tokens, no progress line; the rest of the command as written. The flags still reach the "
     "trainer; the 300-step job on 2 workers is the main job's own tests'. A --monitor-port becomes 0 "
     "(any free port: the doc's may be taken on a test machine)"),
    (lambda a: a[:1] == ["plan"] and "--verify" in a, _verify,
     "--verify builds every rank's model on a fake process group: the doc's 70B at 64 ranks takes ~30 s, "
     f"{VERIFY_MODEL} (8 heads, so tp=8 holds) the same path in ~1 s"),
    (lambda a: a[:1] == ["run"] and any(f in a for f in ("--master-addr", "--master-port", "--rdzv-endpoint")),
     _machines, "a launch across machines (the doc's hosts, 8 ranks each), on this one: the hosts 127.0.0.1, "
     "the port a free one (the doc's may be taken on a test machine), the nodes it needs at least as agents of "
     "their own on this machine (a static launch's node 0 with the other node ranks beside it) with 2 workers "
     "between them, as the 2 cores allow"),
    (lambda a: a[:1] == ["run"] and "examples/train.py" in a, _script_drill,
     "the example script launched by `dtorch run` (12 steps as written): a drill's fault by step 4 (as a "
     "`dtorch train` drill's) and the script to 2 steps past it (its --steps): a fault, its recovery and a "
     "step after it, not 12 steps of which a periodic fault kills 3"),
    (lambda a: a[:1] == ["probe"], _probe, "dtorch probe --quick: the same measurements, fewer shapes and sizes; "
     "--disk DIR: the same calls over 256 MiB (--disk-bytes) instead of 1 GiB"),
    (lambda a: "/shared/ckpt/run1" in a, lambda a: a.__setitem__(a.index("/shared/ckpt/run1"), "runs/train"),
     "a run on a cluster's shared storage: the main job's run directory here"),
]
"""A `dtorch train --chaos` drill keeps the main job's 2 workers (in a subprocess: the launched job's agent
and its workers are not this process's), and its fault strikes by step 4 (`step=N` and `every=N` at most
4) of a run 4 steps longer, with a checkpoint every 2 steps, so that a fault in the checkpoint's phase
comes too; a kill or hang must then show the recovery line, else the drill did not happen."""

def _bench_runner(argv: list[str]) -> None:
    _set(argv, "--only", "mfu")
    if "--quick" not in argv:
        argv.append("--quick")


MODULE_SUBSTITUTIONS = {
    "benchmarks": (_bench_runner, "the benchmark runner (31 min of sections as written) runs one quick section, "
                   "mfu (~5 s): the runner's own flags as the doc gives them (--quick, --out DIR) and its "
                   "latest.{json,md}; --only's sections become mfu"),
    "benchmarks.bench_calibration": (lambda a: None if "--quick" in a else a.append("--quick"),
                                     "--quick: procedure (2) over 2 grid points instead of 12 (the same code, "
                                     "~15 s instead of ~95 s)"),
}
"""`python -m MODULE ...`: how the arguments of a module the docs run at full length are shrunk, and why."""

IN_PROCESS_MODULES = {
    "benchmarks.bench_sweep": "re-predicts a stored sweep: arithmetic over files, no worker processes",
    "dtorch.plan.calibration": "refits the cost model's constants on published rows: arithmetic, no workers",
    "benchmarks": "the runner and its one section (mfu, above) in this process: no worker processes",
    "benchmarks.bench_calibration": "refits on published rows (arithmetic; its sizing figure times a fresh "
                                    "interpreter of its own)",
}
"""`python -m MODULE` runs in this process (as `runpy` runs it: `-m`'s own machinery) for these modules,
each with its reason: it saves an interpreter's start and torch's import; any other in a subprocess."""

ASSIGNMENTS = [
    ("DTORCH_MONITOR_HOST", "10.0.0.5", lambda: _own_address(),
     "10.0.0.5 is an interface of the reader's machine: this machine's own non-loopback address (127.0.0.1 "
     "where it has none)"),
]


def _own_address() -> str:
    """This machine's address on its default route (no packet is sent), else 127.0.0.1."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _launches(argv: list[str]) -> bool:
    """Whether a dtorch command starts worker processes of its own (an elastic agent, probe ranks;
    `probe --disk` times this process's own I/O)."""
    return argv[:1] == ["run"] or argv[:1] == ["probe"] and "--disk" not in argv or argv[:1] == ["train"] and (
        "--chaos" in argv or "--nproc" in argv and argv[argv.index("--nproc") + 1] != "1")


def _recovered(argv: list[str], said: str) -> bool:
    """A drill whose fault kills or stops a rank must have recovered from it (the agent's line)."""
    spec = argv[argv.index("--chaos") + 1] if "--chaos" in argv else ""
    return not re.search(r"\b(kill|hang|killnode)\b", spec) or "dtorch: recovered from" in said


def _inputs(root: Path) -> None:
    """What a reader brings, tiny, under the names the docs use: a Hugging Face Llama directory
    (`./Llama-3.2-1B`: config.json, safetensors, tokenizer.json; written by DTorch's own exporter),
    a JSON-lines corpus (`corpus.jsonl`) and a package with an image classifier (`mypkg.models:cnn`)."""
    import torch.distributed.checkpoint as dcp
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from dtorch.checkpoint.hf_weights import export_hf
    from dtorch.models import build_model, model_config

    docs = [" ".join(["alpha beta gamma delta epsilon"] * (3 + i % 7)) + f" {i}." for i in range(300)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dcp.save({"model": build_model(TINY_LLAMA).state_dict()}, checkpoint_id=str(root / ".dcp"))
    hf = export_hf(root / ".dcp", root / "Llama-3.2-1B", model_config(TINY_LLAMA), family="llama")
    shutil.rmtree(root / ".dcp")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(hf / "tokenizer.json"))
    # `mypkg.models:cnn`, a reader's own image classifier: the suite's (tests/plan/_user_cnn.py)
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "models.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'tests' / 'plan')!r})\n"
        "from _user_cnn import cnn, example_input  # noqa: F401\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment of every command: this one's, with the calibration store, the caches and HOME
    in a temporary directory (a doc's `dtorch probe` or run never touches the user's), and no Slurm
    controller: the suite's own (a 2-node partition `.ci/run` starts) is not the cluster the docs'
    `dtorch submit slurm` examples size for, so Slurm's clients read an empty configuration and fail
    at once, as on a machine without Slurm."""
    root = tmp_path_factory.mktemp("doc-env")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    (root / "slurm.conf").write_text("")
    env.update(HOME=str(root / "home"), DTORCH_CALIBRATION_DIR=str(root / "calibration"),
               DTORCH_CACHE=str(root / "cache"), OMP_NUM_THREADS="1", SLURM_CONF=str(root / "slurm.conf"))
    return env


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, env) -> Path:
    """A reader's directory before a doc's first command: the tiny inputs of `_inputs`, and the
    main job's checkpoints in runs/train (`dtorch train`, shrunk as SUBSTITUTIONS says), which
    the README's first command makes and the other docs take for granted."""
    root = tmp_path_factory.mktemp("doc-inputs")
    _inputs(root)
    code, said = _run(Command("(the main job)", 0, "dtorch train"), root, env)
    assert code == 0, said
    return root


_PURE: dict[tuple[str, ...], tuple[int, str]] = {}


def _run(cmd: Command, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """(exit code, stderr + the end of stdout) of one command, in process where it is `dtorch`."""
    text = _expand(_bare(cmd.text), cwd, env)
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:  # not a plain word list: bash reads it
        tokens = []
    assigns = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        k, _, v = tokens.pop(0).partition("=")
        assigns[k] = next((new() for name, old, new, _why in ASSIGNMENTS if (name, old) == (k, v)), v)
    redirect = None
    if len(tokens) >= 2 and tokens[-2] in (">", ">>"):
        redirect = (tokens[-1], tokens[-2])
        tokens = tokens[:-2]
    shell = not tokens or any(t in ("&&", "||", "|", ";") for t in tokens) or "$(" in text or "`" in text
    if tokens[:1] == ["dtorch"] and not shell:
        argv = tokens[1:]
        for applies, change, _why in SUBSTITUTIONS:
            if applies(argv):
                change(argv)
        pure = (argv[:1] == ["plan"] or argv[:2] == ["submit", "slurm"] and "--now" not in argv) \
            and "--out" not in argv and not redirect and not assigns
        if pure and tuple(argv) in _PURE:  # the same plan in another doc: pure arithmetic, one answer
            return _PURE[tuple(argv)]
        if _launches(argv):  # as the console script runs it, in a process of its own (one per node)
            code, said = _subprocesses([[sys.executable, "-m", "dtorch.cli", *a] for a in _nodes(argv)],
                                       cwd, env, assigns, redirect)
        else:
            code, said = _in_process(argv, cwd, {**env, **assigns}, redirect)
        if code == 0 and not _recovered(argv, said):
            code, said = 1, said + "\n(test) the drill's fault never struck: no 'dtorch: recovered from' line"
        if pure:
            _PURE[tuple(argv)] = code, said
        return code, said
    argv = tokens
    if tokens[:2] == ["python", "-m"] and not shell and tokens[2] in MODULE_SUBSTITUTIONS:
        MODULE_SUBSTITUTIONS[tokens[2]][0](tokens)
    if tokens[:2] == ["python", "-m"] and not shell and not redirect and tokens[2] in IN_PROCESS_MODULES:
        return _in_process(tokens[2:], cwd, {**env, **assigns}, None, module=True)
    if tokens[:2] == ["python", "-m"]:
        argv = [sys.executable, *tokens[1:]]
    if shell or not argv:
        argv = ["bash", "-c", text]
    return _subprocess(argv, cwd, env, assigns, redirect)


def _subprocess(argv: list[str], cwd: Path, env: dict[str, str], assigns: dict[str, str], redirect) -> tuple[int, str]:
    return _subprocesses([argv], cwd, env, assigns, redirect)


def _subprocesses(argvs: list[list[str]], cwd: Path, env: dict[str, str], assigns: dict[str, str],
                  redirect) -> tuple[int, str]:
    """Run these commands at once (the nodes of one launch) and wait for all: the first failure's
    exit code, and what each said (the first command's stdout to a redirect)."""
    import tempfile

    full = {**env, "PYTHONPATH": str(REPO), **assigns, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in argvs]  # no pipe to fill
    procs = [subprocess.Popen(a, cwd=cwd, env=full, stdout=o, stderr=e, text=True) for a, (o, e) in zip(argvs, files)]
    deadline, late = time.monotonic() + 300, False
    try:
        # one node failing fails the launch: the others would wait for it until their own timeouts
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                late = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:  # SIGTERM first: an agent then stops its workers
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    outs = []
    for o, e in files:
        o.seek(0), e.seek(0)
        outs.append((o.read(), e.read()))
        o.close(), e.close()
    if redirect:
        with open(cwd / redirect[0], "a" if redirect[1] == ">>" else "w") as f:
            f.write(outs[0][0])
    code = 124 if late else next((p.returncode for p in procs if p.returncode), 0)
    said = ("(test) killed after 300 s\n" if late else "") + "\n".join((f"(node {i})\n" if len(procs) > 1 else "") + err[-6000:] + out[-2000:]
                     for i, (out, err) in enumerate(outs))
    return code, said


def _expand(text: str, cwd: Path, env: dict[str, str]) -> str:
    """The command with each `$(...)` in its leading VAR=value assignments replaced by what bash prints
    for it (`DTORCH_MONITOR_TOKEN=$(openssl rand -hex 16) dtorch train`), so that the dtorch command
    after them is still read, and shrunk, like any other."""
    m = re.match(r"((?:[A-Z_][A-Z0-9_]*=(?:\$\([^()]*\)|\S+)\s+)+)", text)
    if not m or "$(" not in m.group(1):
        return text

    def value(sub: re.Match) -> str:
        out = subprocess.run(["bash", "-c", sub.group(0)[2:-1]], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=30, check=True)
        return shlex.quote(out.stdout.strip())

    return re.sub(r"\$\([^()]*\)", value, m.group(1)) + text[m.end():]


def _in_process(argv: list[str], cwd: Path, env: dict[str, str], redirect, module: bool = False) -> tuple[int, str]:
    """`dtorch.cli.main(argv)` (with `module`: `python -m argv[0] argv[1:]`, the directory first on
    sys.path as `-m` puts it) in this process, in `cwd` with `env`. A PYTHONPATH in `env` (which acts
    only when an interpreter starts) goes before sys.path for the call, as the console script would
    have it; what was imported from these directories is forgotten after, and a package of that name
    imported before (`benchmarks` from the checkout) is set aside meanwhile."""
    import runpy

    from dtorch.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_env, old_cwd, old_path, old_argv = dict(os.environ), os.getcwd(), list(sys.path), list(sys.argv)
    extra = [str(cwd)] if module else []
    extra += [str((cwd / d).resolve()) for d in env.get("PYTHONPATH", "").split(os.pathsep)
              if d and env.get("PYTHONPATH") != old_env.get("PYTHONPATH")]
    top = argv[0].split(".")[0] if module else None
    aside = {k: sys.modules.pop(k) for k in list(sys.modules)
             if top and (cwd / top).is_dir() and (k == top or k.startswith(top + "."))}
    old_modules = set(sys.modules)
    sys.path[:0] = extra
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if module:
                    sys.argv = list(argv)
                    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
                    code = 0
                else:
                    code = main(argv)
            except SystemExit as e:  # argparse: a bad flag; sys.exit(n)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        sys.path[:], sys.argv[:] = old_path, old_argv
        for name in set(sys.modules) - old_modules:  # a reader's package (mypkg): not the next doc's
            if any(str(getattr(sys.modules[name], "__file__", None) or "").startswith(d + os.sep) for d in extra):
                del sys.modules[name]
        sys.modules.update(aside)
    if redirect:
        with open(cwd / redirect[0], "a" if redirect[1] == ">>" else "w") as f:
            f.write(out.getvalue())
    return code, err.getvalue() + out.getvalue()[-2000:]


def _all() -> list[tuple[Path, list[Command], list[str]]]:
    return [(p, *commands(p)) for p in DOCS]


def test_the_docs_hold_commands_and_mark_few_skips():
    every = [c for _, cmds, _ in _all() for c in cmds]
    skipped = [c for c in every if c.skip or c.long]
    problems = [x for _, _, probs in _all() for x in probs]
    assert not problems, "\n".join(problems)
    assert len(every) >= 40 and len(skipped) < len(every) // 2, (len(every), [(c.text, c.skip) for c in skipped])


def test_skipped_dtorch_commands_still_parse():
    """A skipped command is not run, but its flags (and a drill's --chaos spec) are checked: a renamed
    or removed flag fails here."""
    from dtorch.cli import build_parser
    from dtorch.errors import ConfigError

    bad = []
    for path in DOCS:
        for c in commands(path)[0]:
            tokens = shlex.split(_bare(c.text), comments=True)
            while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
                tokens.pop(0)
            if not c.skip or tokens[:1] != ["dtorch"] or "$(" in c.text:
                continue
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    args = build_parser(tokens[1:]).parse_args(tokens[1:])
                if getattr(args, "chaos", None):  # a drill's fault spec, as the launcher reads it
                    from dtorch.elastic.chaos import parse

                    parse(args.chaos)
            except (SystemExit, ConfigError) as e:
                bad.append(f"{c.doc}:{c.line}: {c.text}\n{err.getvalue()}{e}")
    assert not bad, "\n".join(bad)


def test_the_rule_reads_commands_outputs_skips_and_untagged_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "x.md").write_text("""<!-- doc-test skip: dtorch probe -- minutes -->
```bash
# a comment
.venv/bin/dtorch probe --quick
dtorch plan --model a \\
    --cluster b   # trailing words
```

```console
$ dtorch plan --fix tp=3
dtorch plan: error: tp=3: no
$ dtorch status runs/train \\
    --json
runs/train: finished
```

```
dtorch report runs/train
```

```text
dtorch plan: error: tp=3: output, not a command
```
<!-- doc-test skip: dtorch gone -- stale -->
""")
    cmds, problems = commands(tmp_path / "x.md")
    assert [(c.text, c.expect_code, c.expect_err, bool(c.skip)) for c in cmds] == [
        (".venv/bin/dtorch probe --quick", 0, None, True),
        ("dtorch plan --model a  --cluster b   # trailing words", 0, None, False),
        ("dtorch plan --fix tp=3", 2, "dtorch plan: error: tp=", False),
        ("dtorch status runs/train  --json", 0, None, False)]  # continued
    assert len(problems) == 2 and "without a language" in problems[0]
    assert "'dtorch gone' matches no command" in problems[1]


def test_drills_are_shrunk_launched_apart_and_must_recover(tmp_path):
    argv = ["train", "--chaos", "kill:rank=1:phase=checkpoint:step=50", "--steps", "300"]
    _train(argv)
    assert argv[2] == "kill:rank=1:phase=checkpoint:step=4" and "--nproc" not in argv
    assert argv[argv.index("--steps") + 1] == "8" and argv[argv.index("--checkpoint-every") + 1] == "2"
    assert _launches(argv) and not _recovered(argv, 'dtorch: {"final_step": 8}')  # the fault never struck
    assert _recovered(argv, "dtorch: recovered from exit of rank(s) [1] in 0.9 s")
    every = ["train", "--chaos", "every=20:kill"]
    _train(every)
    assert every[2] == "every=4:kill"
    assert _recovered(["run", "--chaos", "slow:rank=0:factor=3", "x.py"], "")  # a straggler: nothing to recover
    plain = ["train", "--steps", "20"]
    _train(plain)
    assert plain[plain.index("--nproc") + 1] == "1" and not _launches(plain)
    assert _launches(["train", "--nproc", "2"]) and _launches(["probe"]) and not _launches(["plan"])
    assert _launches(["probe", "--nproc", "2"]) and not _launches(["probe", "--disk", "x"])
    script = ["run", "--chaos", "every=20:kill", "examples/train.py", "--checkpoint-dir", "runs/x"]
    _script_drill(script)
    assert script == ["run", "--chaos", "every=4:kill", "examples/train.py", "--steps", "6", "--checkpoint-dir", "runs/x"]
    static = ["run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29500",
              "--nproc-per-node", "8", "t.py"]
    _machines(static)
    nodes = _nodes(static)
    assert [a[a.index("--node-rank") + 1] for a in nodes] == ["0", "1"] and nodes[1][6] == "127.0.0.1"
    assert nodes[0][8] == nodes[1][8] != "29500" and nodes[0][nodes[0].index("--nproc-per-node") + 1] == "1"
    elastic = ["run", "--nnodes", "1:2", "--nproc-per-node", "8", "--rdzv-endpoint", "HOST:29400", "t.py"]
    _machines(elastic)
    assert _nodes(elastic) == [elastic] and elastic[4] == "2" and elastic[6].startswith("127.0.0.1:")
    env = {"PATH": os.environ["PATH"]}
    assert _expand("A=$(echo hi there) B=1 dtorch plan --x", tmp_path, env) == "A='hi there' B=1 dtorch plan --x"
    assert _expand("dtorch plan $(echo a)", tmp_path, env) == "dtorch plan $(echo a)"  # not an assignment: bash's


@pytest.mark.slow  # the docs' 64 commands, drills and probes included
@pytest.mark.beside  # nothing it asserts depends on timing; its drills and probes are short 2-rank jobs
@pytest.mark.parametrize("doc", [p.name for p in DOCS])
def test_every_command_of_the_doc_runs_as_written(doc, inputs, env, tmp_path):
    path = next(p for p in DOCS if p.name == doc)
    cmds, _ = commands(path)
    runnable = [c for c in cmds if not c.skip and not c.long]
    if not runnable:
        pytest.skip(f"{doc}: no commands to run")
    _run_all(runnable, inputs, env, tmp_path)


def _long_docs() -> list[str]:
    return [p.name for p in DOCS if any(c.long for c in commands(p)[0])]


@pytest.mark.slow  # a 2- and 4-rank probe, a launch as two nodes, the benchmark runner: about a minute
@pytest.mark.parametrize("doc", _long_docs())
def test_the_long_commands_run_as_written(doc, inputs, env, tmp_path):
    """The commands a doc marks `long` (each with its reason), in the doc's order, in a directory of
    their own: outside their doc's test so that `scripts/test.sh` runs them in its front session."""
    cmds, _ = commands(next(p for p in DOCS if p.name == doc))
    _run_all([c for c in cmds if c.long], inputs, env, tmp_path)


def test_the_readme_commands_it_skips_are_what_ci_runs():
    """The README's two commands are skipped above (the network; the whole suite, which holds this
    test): CI runs them, on a clean clone: `.ci/run` runs `bash scripts/test.sh`, which runs
    `bash scripts/setup.sh` first. The main job itself (`dtorch train`) runs for every doc (`inputs`)."""
    skipped = [c.text.split("#")[0].strip() for c in commands(REPO / "README.md")[0] if c.skip]
    assert skipped == ["bash scripts/setup.sh && .venv/bin/dtorch train", "bash scripts/test.sh"], skipped
    every = [c for p in DOCS for c in commands(p)[0] if c.skip]
    assert len(every) == 2, [(c.doc, c.text) for c in every]  # nothing else is skipped
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == "exec bash scripts/test.sh", ci[-1]
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    setup = test_sh.index("bash scripts/setup.sh")
    assert setup < test_sh.index("python -m pytest"), "test.sh must set up before it tests"


def _run_all(runnable: list[Command], inputs: Path, env: dict[str, str], tmp_path: Path) -> None:
    """Run `runnable` in order in a copy of `inputs` (with `benchmarks/` and `examples/` when a command
    names them); fail with every command that did not exit as documented."""
    cwd = tmp_path / "cwd"
    shutil.copytree(inputs, cwd)
    for tree in ("benchmarks", "examples"):  # they read (benchmarks: and write) these: a copy of them
        if any(tree in c.text for c in runnable):
            shutil.copytree(REPO / tree, cwd / tree, ignore=shutil.ignore_patterns("__pycache__"))
    failed = []
    for c in runnable:
        t0 = time.perf_counter()
        code, said = _run(c, cwd, env)
        took = time.perf_counter() - t0
        print(f"{c.doc}:{c.line} exit {code} in {took:.1f} s: {c.text}")
        if code != c.expect_code or (c.expect_err and not any(
                line.startswith(c.expect_err) for line in said.splitlines())):
            failed.append(f"{c.doc}:{c.line}: exit {code} (documented {c.expect_code}"
                          f"{', ' + c.expect_err if c.expect_err else ''}): {c.text}\n{said[-1500:]}")
    assert not failed, "\n\n".join(failed)
