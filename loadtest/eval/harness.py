"""lm-evaluation-harness as the external client: its `hf` model (transformers on the checkpoint) and its
`local-completions` model (our OpenAI API) on the task files of loadtest/eval/tasks. lm-eval is imported here
only (the `[eval]` extra; `make eval` installs it); nothing here downloads: the tasks are local JSON files and
HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set before lm-eval loads."""

from __future__ import annotations

import os
from pathlib import Path

from loadtest.common import REPO
from loadtest.eval.compare import responses

TASKS = Path(__file__).parent / "tasks"


def evaluate(model: str, model_args: dict, tasks: list[str], limit: int | None = None, batch_size: int = 1) -> dict:
    """One lm-eval run -> {"results": {task: metrics}, "samples": {task: {doc_id: responses}}}. Runs from the
    repository root, where the task YAMLs' data paths start."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    here = Path.cwd()
    os.chdir(REPO)
    try:
        out = simple_evaluate(model=model, model_args=",".join(f"{k}={v}" for k, v in model_args.items()),
                              tasks=tasks, task_manager=TaskManager(include_path=str(TASKS)), limit=limit,
                              log_samples=True, batch_size=batch_size, random_seed=0, numpy_random_seed=0,
                              torch_random_seed=0, fewshot_random_seed=0)
    finally:
        os.chdir(here)
    return {"results": {t: {k: v for k, v in m.items() if isinstance(v, (int, float))}
                        for t, m in out["results"].items()},
            "samples": {t: responses(s) for t, s in out["samples"].items()}}


def hf_args(model_dir: Path) -> dict:
    return {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}


def api_args(url: str, served: str, model_dir: Path, concurrent: int = 4) -> dict:
    """local-completions against our server: token-id prompts tokenized by the checkpoint's own tokenizer, so
    both runs score exactly the same tokens."""
    return {"base_url": f"{url}/v1/completions", "model": served, "tokenizer_backend": "huggingface",
            "tokenizer": model_dir, "tokenized_requests": True, "num_concurrent": concurrent, "max_retries": 1,
            "timeout": 600}
