"""What a client reads of a failure (app/api/errors.py): one line, the engine's reason or an exception's class and
first line, never the remote traceback Ray wraps it in (the replica's pid, actor id, node IP, file paths), and a 5xx
logged whole under its request id. Ray's own RayTaskError wraps each exception as it does behind Serve."""

from __future__ import annotations

import logging

from ray.exceptions import RayTaskError

from app.api.errors import REQUEST_ID, from_backend, public_reason
from app.engine.errors import EngineUnavailable, QueueTimeout

TRACE = ('Traceback (most recent call last):\n  File "/srv/venv/lib/python3.11/site-packages/ray/serve/_private/'
         'replica.py", line 1214, in handle_request\n    raise err\n')
ACTOR = "a3f6c0e9d1b24f7e8c5d6a7b8c9d0e1f"


def _remote(cause: Exception) -> Exception:
    """`cause` as the ingress receives it from a replica: Ray's RayTaskError, an instance of the cause's class too."""
    return RayTaskError("EngineReplica.generate", TRACE + f"{type(cause).__name__}: {cause}", cause,
                        proctitle="ray::ServeReplica:dasc:EngineReplica", pid=31337, ip="10.1.2.3",
                        actor_id=ACTOR).as_instanceof_cause()


def _clean(text: str) -> None:
    for marker in ("Traceback", "File \"", "/srv/", "10.1.2.3", "31337", ACTOR, "\n"):
        assert marker not in text, (marker, text)


def test_a_remote_engine_refusal_reads_as_the_engine_put_it():
    wrapped = _remote(QueueTimeout("the request did not start before its queue deadline"))
    assert "pid=31337" in str(wrapped) and "10.1.2.3" in str(wrapped)  # what the old message held
    err = from_backend(wrapped)
    assert (err.status, err.code) == (503, "queue_timeout")
    assert err.message == "the request waited too long to start: the request did not start before its queue deadline"
    err = from_backend(_remote(EngineUnavailable("the engine is shut down")))
    assert (err.status, err.code) == (503, "engine_unavailable") and err.retry_after_s
    _clean(err.message)


def test_an_unexpected_remote_failure_names_its_class_and_a_scrubbed_first_line(caplog):
    cause = RuntimeError("engine step failed: RuntimeError('CUDA error at /opt/kernels/attn.cu:88 on 10.9.8.7, "
                         f"pid=4242, actor {ACTOR}')\nmore detail")
    REQUEST_ID.set("cmpl-test-1")
    with caplog.at_level(logging.WARNING, logger="app.api.routes"):
        err = from_backend(_remote(cause))
    assert err.status == 503 and err.message.startswith("generation failed: RuntimeError: engine step failed")
    _clean(err.message)
    assert "<path>" in err.message and "<address>" in err.message and "pid=<pid>" in err.message
    logged = caplog.text  # the whole detail, under the request's id, for the operator
    assert "cmpl-test-1" in logged and "/opt/kernels/attn.cu" in logged and "pid=31337" in logged


def test_a_bad_request_raised_remotely_is_a_400_with_its_message_alone():
    err = from_backend(_remote(ValueError("prompt (5000 tokens) + max_tokens (16) exceeds the context length 4096")))
    assert err.status == 400 and err.message == "prompt (5000 tokens) + max_tokens (16) exceeds the context length 4096"


def test_a_dead_replica_is_a_503_engine_unavailable():
    from ray.exceptions import ActorDiedError

    err = from_backend(ActorDiedError())
    assert (err.status, err.code) == (503, "engine_unavailable") and err.retry_after_s
    _clean(err.message)


def test_public_reason_keeps_short_plain_reasons():
    assert public_reason(ValueError("max_tokens must be at least 1")) == "max_tokens must be at least 1"
    assert len(public_reason(ValueError("x" * 1000))) == 300
