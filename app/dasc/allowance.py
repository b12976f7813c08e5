"""The answer-quality allowance of a model: which cache settings the tuning controller may use.

Computed by measurement (`python -m app.calibrate MODEL`, see app/calibrate.py and docs/serving.md, "Answer
quality: the allowance") and stored as `allowance.json` next to the model. This module only names the settings
and reads the file: serving code loads it without the calibration's training-corpus dependencies.
"""

from __future__ import annotations

import json
from pathlib import Path

ALLOWANCE_FILE = "allowance.json"
W_VALUES = (16, 64, 128, 512, 1024)  # the W_max values of the tuner's ladder, each calibrated with nr and wr
POLICIES = ("nr", "wr")
NLL_TOLERANCE = 0.005  # (a) continuation NLL of hits within 0.5% of the same hits under dense checkpoints
MIN_AGREEMENT = 0.95  # (b) the first GREEDY_TOKENS greedy tokens equal a cold run's on 95% of prompts
GREEDY_TOKENS = 32


def setting_label(w_max: float | None, policy: str) -> str:
    """`dense`, or e.g. `nr-W16`: how settings are named in the allowance, the tuner and /status."""
    return "dense" if w_max is None else f"{policy}-W{w_max:g}"


def read_allowance(model_dir: str | Path) -> dict | None:
    """The model's allowance record, or None when it has none (then only dense is allowed)."""
    path = Path(model_dir) / ALLOWANCE_FILE
    return json.loads(path.read_text()) if path.exists() else None
