"""`dtorch train --config FILE` (TOML or YAML) and `--print-config`: the file's fields are JobConfig's,
checked against a schema derived from it; a mistake is one line naming the field with exit 2; a
flag given on the command line overrides the file; the printed configuration read back is the same job.
All in process through `dtorch.cli.main` with `--print-config` (nothing trains)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import yaml

from dtorch.cli import main
from dtorch.train.config import dumps, read, schema
from dtorch.train.job import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # the parser dtorch uses there (a dependency on Python 3.10)
    import tomli as tomllib


def _printed(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["train", *argv, "--print-config"] if "--print-config" not in " ".join(argv) else
                ["train", *argv]) == 0
    return capsys.readouterr().out


def _error(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_every_job_config_field_is_in_the_schema_with_its_type_and_default():
    props = schema(JobConfig)["properties"]
    fields = dataclasses.fields(JobConfig)
    assert list(props) == [f.name for f in fields]
    for f in fields:
        assert props[f.name]["default"] == f.default and props[f.name]["description"] == f.metadata["help"]
    assert props["steps"]["type"] == "integer" and props["lr"]["type"] == "number"
    assert props["nproc"]["type"] == ["integer", "null"] and props["rebalance"]["type"] == "boolean"
    assert props["lr_schedule"]["enum"] == ["constant", "cosine", "linear", "wsd"]
    assert schema(JobConfig)["additionalProperties"] is False


@pytest.mark.parametrize("ext", ["toml", "yaml"])
def test_printed_config_fed_back_is_the_same_job(tmp_path, capsys, ext):
    src = tmp_path / f"job.{ext}"
    fields = {"steps": 7, "global_batch": 8, "offload": "optimizer", "rebalance": True, "lr": 1e-5,
              "data": "corpus \"quoted\" ü.bin", "heartbeat_timeout": 12.5}
    src.write_text(tomllib_dumps(fields) if ext == "toml" else yaml.safe_dump(fields))
    out = _printed(capsys, "--config", str(src))  # the format follows --config's extension
    (tmp_path / f"out.{ext}").write_text(out)
    config = JobConfig.from_dict(read(tmp_path / f"out.{ext}", JobConfig))
    assert config == JobConfig(**fields)
    assert _printed(capsys, "--config", str(tmp_path / f"out.{ext}")) == out  # a fixed point
    other = "yaml" if ext == "toml" else "toml"
    (tmp_path / f"x.{other}").write_text(_printed(capsys, "--config", str(src), "--print-config", other))
    assert JobConfig.from_dict(read(tmp_path / f"x.{other}", JobConfig)) == config


def tomllib_dumps(fields: dict) -> str:
    text = dumps(JobConfig(**fields), "toml")
    assert tomllib.loads(text)  # what dumps writes is TOML
    return text


def test_flags_given_override_the_file_and_the_rest_keep_the_files_values(tmp_path, capsys):
    src = tmp_path / "job.toml"
    src.write_text('steps = 7\nseq_len = 32\nrebalance = true\nno_progress = true\nmodel = "gpt2"\n')
    out = tomllib.loads(_printed(capsys, "--config", str(src), "--steps", "9", "--no-rebalance", "--progress"))
    assert (out["steps"], out["seq_len"], out["rebalance"], out["no_progress"], out["model"]) == (9, 32, False, False,
                                                                                                     "gpt2")
    # a flag at its default value still overrides the file
    assert tomllib.loads(_printed(capsys, "--config", str(src), "--seq-len", "128"))["seq_len"] == 128
    # no file: the flags over JobConfig's defaults
    assert tomllib.loads(_printed(capsys, "--steps", "3")) == {
        k: v for k, v in dataclasses.asdict(JobConfig(steps=3)).items() if v is not None}


def test_a_misspelt_field_is_one_line_naming_it_with_the_nearest_option(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text("global_bacth: 8\n")
    err = _error(capsys, "--config", str(tmp_path / "job.yaml"))
    assert err.startswith("dtorch train: error: global_bacth=8:") and "did you mean global_batch?" in err


@pytest.mark.parametrize(("text", "field", "says"), [
    ('steps = "ten"', "steps='ten'", "expected an integer"),
    ("steps = true", "steps=True", "expected an integer"),  # a bool is not an integer
    ('offload = "gpu"', "offload='gpu'", "use one of {none, optimizer, optimizer_nvme}"),
    ("nproc = 1.5", "nproc=1.5", "expected an integer or nothing"),
])
def test_a_bad_value_is_one_line_naming_the_field_exit_2(tmp_path, capsys, text, field, says):
    (tmp_path / "job.toml").write_text(text + "\n")
    err = _error(capsys, "--config", str(tmp_path / "job.toml"))
    assert err.startswith(f"dtorch train: error: {field}: ") and says in err and "job.toml" in err


def test_a_value_wrong_on_its_own_is_refused_like_its_flag(tmp_path, capsys):
    (tmp_path / "job.toml").write_text('lr_schedule = "wsd"\nlr_decay_ratio = 2.0\n')
    assert "lr_decay_ratio" in _error(capsys, "--config", str(tmp_path / "job.toml"), "--print-config")


def test_files_that_are_not_a_job_description(tmp_path, capsys):
    (tmp_path / "job.ini").write_text("steps=1\n")
    assert "use a .toml, .yaml or .yml file" in _error(capsys, "--config", str(tmp_path / "job.ini"))
    (tmp_path / "bad.toml").write_text("steps = \n")
    assert "not valid TOML" in _error(capsys, "--config", str(tmp_path / "bad.toml"))
    (tmp_path / "list.yaml").write_text("- steps\n")
    assert "a table of fields" in _error(capsys, "--config", str(tmp_path / "list.yaml"))
    assert "cannot read" in _error(capsys, "--config", str(tmp_path / "missing.toml"))
    (tmp_path / "empty.yaml").write_text("")  # an empty file: the defaults
    assert tomllib.loads(_printed(capsys, "--config", str(tmp_path / "empty.yaml"), "--print-config", "toml"))[
        "steps"] == JobConfig().steps
