"""The Dockerfile builds the image `dtorch submit k8s` names by default, and installs what the
pods run (the package with its Kubernetes, transformers and NVML extras). Building it needs a
Docker daemon, which CI does not have: this checks that the two stay in step."""

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _default_image() -> str:
    """The default of `dtorch submit k8s --image`, read from the CLI's own parser."""
    from dtorch.cli import submit

    parser = argparse.ArgumentParser()
    submit.add_parser(parser.add_subparsers(), "submit")
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in p._actions:
            if "--image" in action.option_strings:
                return action.default
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    raise AssertionError("dtorch submit k8s has no --image option")


def test_the_dockerfile_builds_the_image_the_manifests_name():
    text = (ROOT / "Dockerfile").read_text()
    image = _default_image()
    assert f"docker build -t {image} ." in text
    assert "COPY dtorch ./dtorch" in text and 'pip install --no-cache-dir ".[hf,gpu,k8s]"' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
