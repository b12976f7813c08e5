"""Training smoke test: a few optimizer steps write a loadable checkpoint, and --resume continues. Step budgets, not
minutes, so that the run does the same work on a loaded machine."""

from __future__ import annotations

import json

import torch

from app.models.loader import load_model
from app.training import corpus
from app.training.train import lr_at, main, phase_at


def test_schedule_shapes():
    assert lr_at(0.0, 1e-3) == 0.0 and abs(lr_at(0.02, 1e-3) - 1e-3) < 1e-12
    assert abs(lr_at(1.0, 1e-3) - 1e-4) < 1e-12
    assert phase_at(0.0).seq_len < phase_at(0.99).seq_len


def test_train_then_resume(tmp_path, monkeypatch):
    a_third = corpus.stdlib_files()[::3]  # the same code paths on a third of the corpus to tokenize
    monkeypatch.setattr(corpus, "stdlib_files", lambda: a_third)
    out = tmp_path / "run"
    main(["--preset", "gdn-tiny", "--out", str(out), "--max-steps", "1", "--threads", "1", "--save-every", "0.01"])
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    first_steps = log[-1]["step"]
    assert first_steps == 1 and "held_out_loss" in log[-1]
    model = load_model(out / "model")
    assert (out / "model" / "tokenizer.json").exists()
    with torch.no_grad():
        assert torch.isfinite(model.forward_train(torch.tensor([[1, 2, 3, 4]]))).all()
    main(["--preset", "gdn-tiny", "--out", str(out), "--max-steps", "2", "--threads", "1", "--resume"])
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] > first_steps and log[-1]["step"] == 2
    assert [r["step"] for r in log] == list(range(1, log[-1]["step"] + 1))
