"""The reliability suite of issue 20: `python -m loadtest.reliability [--only NAME,...] [--out docs/reliability.md]`
(`make reliability` runs every scenario with `--out docs/reliability.md`, within 30 minutes on 2 cores).

Without `--url`, the suite starts its own Ray Serve apps on loopback (configs/config.yaml with the controller
not tuning, so greedy outputs are comparable; configs/tp2.yaml; a two-node cluster; the main app with a disk
tier, and with one smaller than an entry) and runs each scenario
against the app it needs. With `--url` (e.g. `python -m app.api.local --port 8123`) it runs the scenarios that
need only HTTP against that server and skips the rest. Every scenario is bounded in requests and in time, prints
its figures and criteria, saves them (loadtest/results/reliability/reliability_cpu.json, one variant per
scenario) and, given `--out`, replaces its own block in the doc (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

from loadtest.common import RESULTS, start_run, table
from loadtest.faults import catalogue, disk, fuzz, load, peer
from loadtest.faults.client import Outcome, Target
from loadtest.sections import publish

RELIABILITY_RESULTS = RESULTS / "reliability"


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: object  # (Target, SimpleNamespace) -> Outcome
    app: str  # "http" (any server), "main" (the Ray app), "tp" (configs/tp2.yaml), "two_node", "disk", "disk_tiny",
    # "fetch" (the main app with peer fetches)
    opts: dict
    short: dict  # --short overrides (a quick pass, not the figures)


def _cluster_run(name: str):
    def run(target: Target, opts) -> Outcome:
        from loadtest.faults import cluster

        return getattr(cluster, name)(target, opts)

    return run


SCENARIOS = {s.name: s for s in [
    Scenario("fuzz", "Schema fuzzing (schemathesis)", fuzz.run, "http",
             {"requests": 600, "timeout_s": 30.0, "budget_s": 240.0}, {"requests": 120}),
    Scenario("catalogue", "Bad-input catalogue", catalogue.run, "http", {"timeout_s": 120.0, "budget_s": 420.0}, {}),
    Scenario("storm", "Disconnect storm", load.storm, "http",
             {"streams": 1000, "concurrency": 16, "timeout_s": 30.0, "budget_s": 300.0}, {"streams": 200}),
    Scenario("overload", "Overload burst", load.overload, "http",
             {"burst": 256, "max_tokens": 64, "timeout_s": 90.0, "recover_s": 120.0}, {"burst": 96}),
    Scenario("soak", "Soak", load.soak, "http",
             {"duration_s": 600.0, "warmup_s": 60.0, "concurrency": 4, "sample_s": 10.0}, {"duration_s": 120.0,
                                                                                          "warmup_s": 30.0}),
    Scenario("replica_kill", "Replica kill under load", _cluster_run("replica_kill"), "main",
             {"concurrency": 8, "recover_s": 30.0, "timeout_s": 60.0}, {}),
    Scenario("ingress_kill", "Ingress kill under load", _cluster_run("ingress_kill"), "main",
             {"concurrency": 4, "recover_s": 60.0, "timeout_s": 30.0}, {}),
    Scenario("controller_kill", "Controller kill under load", _cluster_run("controller_kill"), "main",
             {"concurrency": 4, "timeout_s": 30.0}, {}),
    Scenario("tp_rank_kill", "TP rank kill", _cluster_run("tp_rank_kill"), "tp",
             {"concurrency": 4, "recover_s": 60.0, "timeout_s": 60.0}, {}),
    Scenario("two_node", "Two-node failover", _cluster_run("two_node_failover"), "two_node",
             {"concurrency": 4, "recover_s": 30.0, "timeout_s": 30.0}, {}),
    Scenario("disk_corrupted", "Disk tier files corrupted while serving", disk.corrupted, "disk",
             {"concurrency": 16, "duration_s": 45.0, "every_s": 0.3, "settle_s": 30.0, "timeout_s": 120.0},
             {"duration_s": 20.0}),
    Scenario("disk_unwritable", "Disk tier directory becomes unwritable", disk.unwritable, "disk",
             {"concurrency": 16, "duration_s": 45.0, "settle_s": 30.0, "timeout_s": 120.0}, {"duration_s": 20.0}),
    Scenario("holder_kill", "Holder killed mid-fetch", peer.holder_kill, "fetch",
             {"rounds": 3, "concurrency": 16, "prefix_lines": 140, "question_lines": 20, "fetch_wait_s": 10.0,
              "recover_s": 60.0, "timeout_s": 120.0}, {"rounds": 1}),
    Scenario("disk_tiny", "Disk tier smaller than one entry", disk.tiny, "disk_tiny",
             {"concurrency": 16, "duration_s": 30.0, "settle_s": 30.0, "timeout_s": 120.0}, {"duration_s": 15.0}),
]}


def render(outcome: Outcome) -> str:
    """The doc block's body: criteria, figures, the first findings."""
    if outcome.skipped:
        return f"Skipped: {outcome.skipped}"
    rows = [[name, c["want"], _cell(c["got"]), "pass" if c["pass"] else "**FAIL**"]
            for name, c in outcome.criteria.items()]
    text = table(["criterion", "want", "got", "result"], rows)
    text += "\n\n" + table(["figure", "value"], [[k, _cell(v)] for k, v in outcome.figures.items()])
    if outcome.findings:
        text += f"\n\nFindings ({len(outcome.findings)} kept):\n\n"
        text += "\n".join(f"- `{_cell(f)[:400]}`" for f in outcome.findings[:8])
    return text


def _cell(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s.replace("|", "\\|").replace("`", "'").replace("\n", " ")


def select(only: str | None) -> list[Scenario]:
    names = [n.strip() for n in only.split(",") if n.strip()] if only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; --list shows them")
    return [SCENARIOS[n] for n in names]


def options(scenario: Scenario, short: bool) -> SimpleNamespace:
    return SimpleNamespace(**{**scenario.opts, **(scenario.short if short else {})})


def run_one(scenario: Scenario, target: Target | None, short: bool) -> Outcome:
    """The scenario's outcome; an exception in it is a failed outcome, not the suite's end."""
    if target is None:
        return Outcome(skipped=f"needs the suite's own Ray app ({scenario.app}); run without --url")
    try:
        return scenario.run(target, options(scenario, short))
    except Exception as exc:  # noqa: BLE001 - report and go on with the next scenario
        out = Outcome()
        out.check("ran to the end", False, "no exception", repr(exc))
        out.find(traceback=traceback.format_exc()[-1500:])
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--only", help="comma-separated scenario names")
    p.add_argument("--url", help="an already running server: run only the scenarios that need HTTP alone")
    p.add_argument("--pid", type=int, help="with --url: the server's pid (the soak reads its RSS)")
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--config", default="configs/config.yaml")
    p.add_argument("--tp-config", default="configs/tp2.yaml")
    p.add_argument("--short", action="store_true", help="smaller counts and a 2-minute soak (a quick pass)")
    p.add_argument("--out", help="the doc whose scenario blocks are replaced (docs/reliability.md)")
    args = p.parse_args(argv)
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:16} {s.app:9} {s.title}")
        return 0
    chosen = select(args.only)
    run = start_run("reliability", {k: v for k, v in vars(args).items() if k not in ("out", "list")}, argv)
    failed = []
    for app, group in _groups(chosen):
        for scenario, outcome in _run_group(app, group, args):
            title = f"{scenario.title} ({scenario.name})"
            print(f"== {title}: {'skipped' if outcome.skipped else 'pass' if outcome.passed else 'FAIL'}")
            publish(run, scenario.name, outcome.as_dict(), render(outcome), args.out, "Reliability", title,
                    RELIABILITY_RESULTS)
            if not outcome.passed:
                failed.append(scenario.name)
    print(f"failed or skipped: {failed}" if failed else "all scenarios passed")
    return 1 if failed else 0


def _groups(chosen: list[Scenario]) -> list[tuple[str, list[Scenario]]]:
    """Scenarios by the app they run against, HTTP-only ones on the main app, in a fixed order."""
    order = ("main", "tp", "two_node", "disk", "disk_tiny", "fetch")
    return [(app, [s for s in chosen if (s.app if s.app != "http" else "main") == app]) for app in order
            if any((s.app if s.app != "http" else "main") == app for s in chosen)]


def _run_group(app: str, group: list[Scenario], args):
    if args.url:
        target = Target(args.url, args.model, args.pid)
        for s in group:
            yield s, run_one(s, target if s.app == "http" else None, args.short)
        return
    from loadtest.faults import cluster

    with cluster.started(app, args) as target:
        for s in group:
            yield s, run_one(s, target, args.short)


if __name__ == "__main__":
    sys.exit(main())
