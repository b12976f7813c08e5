"""Schema fuzzing: requests that schemathesis (the `reliability` extra) generates from the server's own
/openapi.json, positive (fitting the schema) and negative (not fitting), sent to every operation.

Hypothesis drives generation with `derandomize=True` (the same run sends the same requests) and without its
example database. The test body records and never raises, so there is no shrinking: each request is sent once.
Valid generation lengths are capped (`cheap`): a fuzzed `max_tokens` of 900 with `n` 16 is a correct request
that takes a minute on 2 cores, which would spend the suite's time on generation instead of on inputs; values
outside the valid range are kept as drawn.
"""

from __future__ import annotations

import time

from loadtest.faults.client import Outcome, tally

CAPS = {"max_tokens": (8, 1024), "max_completion_tokens": (8, 1024), "max_output_tokens": (8, 1024), "n": (2, 16)}


def cheap(body):
    """`body` with valid generation lengths above their cap lowered to it (see the module doc)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key, (cap, top) in CAPS.items():
        v = out.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and cap < v <= top:
            out[key] = cap
    return out


def plan(operations: list[tuple[str, str]], total: int) -> list[tuple[str, str, str, int]]:
    """(method, path, mode, examples) for each operation and mode: 5 per mode for a GET (these have no
    parameters: about one distinct request each), the rest of `total` split evenly over the POSTs' modes."""
    gets = [(m, p) for m, p in operations if m == "GET"]
    posts = [(m, p) for m, p in operations if m != "GET"]
    per_post = max(1, (total - 2 * len(gets)) // max(1, 2 * len(posts)))
    return [(m, p, mode, 5 if m == "GET" else per_post) for m, p in gets + posts for mode in ("positive", "negative")]


def run(target, opts) -> Outcome:
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    out, classes, unsatisfiable, per_op = Outcome(), [], [], {}
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json", timeout=30)
    ops = {(op.method.upper(), op.path): op for op in (r.ok() for r in schema.get_all_operations())}
    deadline = time.monotonic() + opts.budget_s
    session = requests.Session()
    for method, path, mode, examples in plan(list(ops), opts.requests):
        strategy = ops[(method, path)].as_strategy(generation_mode=GenerationMode(mode))

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(strategy)
        def probe(case):
            if time.monotonic() > deadline:
                return
            if isinstance(case.body, dict):
                case.body = cheap(case.body)
            try:
                resp = case.call(base_url=target.url, session=session, timeout=opts.timeout_s)
            except requests.Timeout:
                classes.append("hang")
                out.find(kind="hang", request=_show(case))
                return
            except requests.ConnectionError as exc:
                classes.append("no_answer")
                out.find(kind="no_answer", request=_show(case), error=repr(exc)[:200])
                return
            kind = "5xx" if resp.status_code >= 500 else f"{resp.status_code // 100}xx"
            classes.append(kind)
            if resp.status_code >= 500:
                out.find(kind=kind, status=resp.status_code, request=_show(case), answer=resp.text[:300])

        before, t0 = len(classes), time.monotonic()
        try:
            probe()
        except Unsatisfiable:  # a negative request to an operation without parameters cannot exist
            unsatisfiable.append(f"{method} {path} {mode}")
        per_op[f"{method} {path} {mode}"] = [len(classes) - before, round(time.monotonic() - t0, 1)]
    counts = tally(classes)
    out.figures = {"requests": len(classes), "by_status": counts, "operations": len(ops), "no_negative": unsatisfiable,
                   "per_operation": per_op,
                   "schemathesis": schemathesis.__version__}
    out.check("requests sent", len(classes) >= min(500, opts.requests), f">= {min(500, opts.requests)}",
              len(classes))
    out.check("no 5xx", not counts.get("5xx"), "0", counts.get("5xx", 0))
    out.check("no hang", not counts.get("hang") and not counts.get("no_answer"),
              f"0 (answer within {opts.timeout_s:g} s)", counts.get("hang", 0) + counts.get("no_answer", 0))
    return out


def _show(case) -> str:
    body = case.body if isinstance(case.body, (dict, list, str, int, float, bool, type(None))) else "(none)"
    return f"{case.method} {case.path} query={case.query} headers={case.headers} body={body!r}"[:600]
