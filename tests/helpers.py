"""Shared test helpers."""

from __future__ import annotations

import torch
from prometheus_client.parser import text_string_to_metric_families

from app.engine.engine import Engine
from app.models.loader import ZOO_DIR, load_model
from app.models.tokenizer import Tokenizer


def load_zoo(name: str):
    torch.set_num_threads(2)
    d = ZOO_DIR / name
    return load_model(d), Tokenizer.from_dir(d)


def record_logits(engine: Engine) -> dict:
    """Wrap the runner so every next-token logit vector is kept, keyed by (request, seq, position). Greedy
    rows come back as logits too (`keep_logits`) and are picked on the host."""
    seen, run = {}, engine.run_works
    engine.keep_logits = True

    def recording(works):
        picked, logits = run(works)
        for w in works:
            if id(w.seq) in logits:
                seen[(w.seq.request_id, w.seq.index, w.end)] = logits[id(w.seq)].clone()
        return picked, logits

    engine.run_works = recording
    return seen


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text page (parsed by prometheus_client's parser), by (sample name, label
    set as a frozenset of (name, value) pairs)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
