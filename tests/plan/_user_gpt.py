"""A user's nanoGPT-style model for `dtorch plan --model _user_gpt:gpt` (token input, no example)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _pipeline_models import hand_gpt  # noqa: E402


def gpt():
    return hand_gpt()
