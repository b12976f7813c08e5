"""Load policies seen in the engine's outputs: on a checkpoint hit, nr (omitted units zero-filled) gives
next-token logits visibly off the dense ones, wr (omitted units refreshed by a replay) gives the dense ones.

The prompt is shorter than the wr window at W_max = 64, so wr replays it from position 0 and is exact; at
W_max = 64 both zoo models omit units, so nr is not."""

from __future__ import annotations

import pytest
import torch

from app.dasc.policy import wr_window
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo, record_logits

W_MAX = 64
LOGIT_TOL = 1e-4
NR_GAP = 0.1  # nr's hit logits differ from dense by 1.2-3.4 (max abs) on these models and prompt
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module", params=["kda-tiny", "gdn-tiny"])
def zoo(request):
    return load_zoo(request.param)


def _hit(engine: Engine, prompt: list[int]) -> tuple[list, torch.Tensor]:
    """Serve `prompt` twice, one after the other: (outputs, next-token logits of the second request's prompt)."""
    seen = record_logits(engine)
    outs = [engine.generate([prompt], GREEDY)[0][0] for _ in range(2)]
    assert outs[1].cached_tokens == len(prompt) - 1
    return outs, seen[(outs[1].request_id, 0, len(prompt))]


def test_nr_and_wr_hits_differ_as_their_load_policies_say(zoo):
    model, tok = zoo
    prompt = tok.encode(PROMPT)
    dense_outs, dense = _hit(Engine(model, tok, EngineConfig(checkpoint_slots=8)), prompt)
    # no recompute tail: the nr load policy itself (zero-filled units) is under test
    nr_engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=W_MAX, policy="nr", recompute_tail=0))
    wr_engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=W_MAX, policy="wr"))
    assert wr_engine.plan.retained_units < wr_engine.plan.total_units and len(prompt) < wr_window(wr_engine.plan)
    _, nr = _hit(nr_engine, prompt)
    wr_outs, wr = _hit(wr_engine, prompt)
    assert (nr - dense).abs().max().item() > NR_GAP
    assert (wr - dense).abs().max().item() <= LOGIT_TOL
    assert [o.output_ids for o in wr_outs] == [o.output_ids for o in dense_outs]
    assert nr_engine.telemetry.wr_replay_tokens == 0 and wr_engine.telemetry.wr_replay_tokens == len(prompt) - 1
