"""Scenarios of the reliability suite (`python -m loadtest.reliability`, docs/reliability.md).

Each scenario is a function `run(target, opts) -> Outcome`: it drives the service at `target` (a base URL, and
for Ray-backed targets a `cluster.Cluster` to reach replicas and processes), bounded in requests and in time,
and returns its figures and a pass/fail per criterion of issue 20. Modules: `client` (raw HTTP over loopback,
answer classification, the outcome record), `catalogue` (the bad inputs), `fuzz` (schemathesis), `load`
(disconnect storm, overload burst, soak), `cluster` (Ray: starting apps, killing replicas, ingress, controller,
a TP rank and a node).
"""
