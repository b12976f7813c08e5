"""The fingerprints that key disk tier entries (app/cache/fingerprint.py): stable for the same model and codec,
different for a changed weight, config, shape or dtype, or any codec setting."""

from __future__ import annotations

import copy
import dataclasses

import torch

from app.cache.fingerprint import codec_fingerprint, model_fingerprint
from tests.helpers import load_zoo


def test_the_model_fingerprint_follows_weights_config_and_dtypes():
    model, _ = load_zoo("kda-tiny")
    config = dataclasses.asdict(model.config)
    base = model_fingerprint(model, config)
    assert model_fingerprint(copy.deepcopy(model), config) == base
    changed = copy.deepcopy(model)
    with torch.no_grad():
        next(changed.parameters()).view(-1)[0] += 1e-3
    assert model_fingerprint(changed, config) != base
    assert model_fingerprint(model, {**config, "vocab_size": config["vocab_size"] + 1}) != base
    assert model_fingerprint(copy.deepcopy(model).to(torch.bfloat16), config) != base


def test_the_codec_fingerprint_follows_every_setting():
    base = dict(w_max=16.0, policy="nr", quant="none", layout="ragged", selector="static", tail=64)
    fp = codec_fingerprint(**base)
    assert codec_fingerprint(**base) == fp
    for change in (dict(w_max=None), dict(policy="wr"), dict(quant="int8"), dict(layout="padded"),
                   dict(selector="random:0"), dict(tail=0)):
        assert codec_fingerprint(**{**base, **change}) != fp, change
    assert codec_fingerprint(**base, tp_size=2) != fp and codec_fingerprint(**base, placement="balanced") != fp
