"""Ray-backed targets and the fault scenarios that need them: a replica, the ingress, the tuning controller and
a TP rank killed under load, and a two-node cluster losing its worker node.

`started(app, args)` brings up what a group of scenarios needs, on loopback, and tears it down: "main" (the
serve config's app with the controller not tuning, so the cache setting is fixed), "tp" (the TP config), or
"two_node" (`ray start --head` plus a second `ray start --address` node on this machine, then `serve deploy`
of the config: the proxy on the head only, replicas reserving a whole CPU so that Serve spreads them over both
nodes).

Replica methods used through `serve.get_deployment_handle("EngineReplica", "dasc")`: `check_integrity()`
(see docs/reliability.md for its contract). Processes are found in the GCS actor table (no dashboard needed).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import yaml

from loadtest.common import wait_healthy
from loadtest.faults.background import BackgroundLoad
from loadtest.faults.client import Outcome, Target
from loadtest.serve_harness import free_port, serve_app

APP = "dasc"
FIXED_SETTING = {"controller": {"enabled": False}}  # telemetry still flows (/metrics); nothing is retuned


def merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in, dicts recursively (a serve config's args and the suite's overrides)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def app_args(config: str | Path, overrides: dict | None = None) -> dict:
    """The `args` of the config's first application, with `overrides` merged in."""
    apps = yaml.safe_load(Path(config).read_text())["applications"]
    return merge(apps[0].get("args") or {}, overrides or {})


class Cluster:
    """The running app's processes: replica actors by deployment (from the GCS actor table) and, on two nodes,
    the worker node's `ray start` process."""

    def __init__(self, args: dict, worker: subprocess.Popen | None = None) -> None:
        self.args, self.worker = args, worker

    def actors(self, deployment: str) -> list[dict]:
        from ray._private.state import actors

        cls = f"ServeReplica:{APP}:{deployment}"
        return [a for a in actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == cls]

    def replica_pids(self) -> dict[str, int]:
        return {f"{d}:{a['Name'][-8:]}": a["Pid"] for d in ("EngineReplica", "Ingress") for a in self.actors(d)}

    def kill(self, deployment: str) -> str:
        """Kill one replica actor of `deployment` (Serve starts a new one); -> its name."""
        import ray

        name = self.actors(deployment)[0]["Name"]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def integrity(self, attempts: int = 8) -> list[dict]:
        """`check_integrity()` of every engine replica (calls are routed by load: repeated until each replica
        answered, at most `attempts` rounds); -> one dict per replica, `ok` False with the error on failure."""
        from ray import serve

        handle, want = serve.get_deployment_handle("EngineReplica", APP), len(self.actors("EngineReplica"))
        seen: dict[str, dict] = {}
        for _ in range(attempts):
            try:
                for r in [handle.check_integrity.remote() for _ in range(want)]:
                    res = r.result(timeout_s=60)
                    seen[res["replica"]] = {"ok": True, **res}
            except Exception as exc:  # noqa: BLE001 - a leak (AssertionError) or a missing method: report it
                return [*seen.values(), {"ok": False, "error": repr(exc)[:300]}]
            if len(seen) >= want:
                break
        return list(seen.values())

    def wait_replicas(self, deployment: str, n: int, within_s: float, old: set[str] = frozenset()) -> float | None:
        """Seconds until `n` replicas of `deployment` are alive, none of them named in `old`; None if not."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within_s:
            names = {a["Name"] for a in self.actors(deployment)}
            if len(names) >= n and not names & old:
                return time.monotonic() - t0
            time.sleep(0.5)
        return None


@contextmanager
def started(app: str, args):
    if app == "two_node":
        with two_nodes(args.config, FIXED_SETTING, args.model) as target:
            yield target
        return
    config = args.tp_config if app == "tp" else args.config
    if not Path(config).exists():
        yield None  # the group's scenarios are reported as skipped
        return
    with _disk_dir(app) as disk:
        cfg = app_args(config, merge(merge(FIXED_SETTING, disk), _fetching(app)))
        with serve_app(cfg, num_cpus=max(4, 2 * cfg.get("replicas", 2) * cfg.get("tp_size", 1))) as url:
            yield Target(url, args.model, cluster=Cluster(cfg))


def _fetching(app: str) -> dict:
    """For the "fetch" app: the engine and router knobs of peer fetches ({} for the others)."""
    if app != "fetch":
        return {}
    from loadtest.faults import peer

    return {"engine": peer.FETCH_ENGINE, "router": peer.FETCH_ROUTER}


@contextmanager
def _disk_dir(app: str):
    """For the disk apps ("disk", "disk_tiny"): the engine knobs of a disk tier in a fresh directory, with a secret
    for this run in the environment the replicas inherit; removed afterwards. {} for the others."""
    if app not in ("disk", "disk_tiny"):
        yield {}
        return
    from loadtest.faults import disk

    root = Path(tempfile.mkdtemp(prefix="dasc-disk-tier-"))
    os.environ[disk.SECRET_ENV] = secrets.token_hex(16)
    engine = {**disk.DISK_ENGINE, "disk_dir": str(root / "tier")}
    if app == "disk_tiny":
        engine["disk_mb"] = disk.TINY_MB
    try:
        yield {"engine": engine}
    finally:
        os.environ.pop(disk.SECRET_ENV, None)
        shutil.rmtree(root, ignore_errors=True)


def _under_load(target: Target, o, fault, settle_s: float = 5.0):
    """Run `fault()` (-> figures) after `settle_s` of background load; -> (load, kill time, figures)."""
    with BackgroundLoad(target.url, target.model, o.concurrency, max_s=settle_s + o.recover_s + 30,
                        timeout_s=o.timeout_s) as load:
        time.sleep(settle_s)
        t_kill = time.monotonic()
        figures = fault()
        while load.first_ok_after(t_kill) is None and time.monotonic() - t_kill < o.recover_s:
            time.sleep(0.5)
        time.sleep(2)  # the requests in flight at recovery finish or fail: both are counted
    return load, t_kill, figures


def _fates(load: BackgroundLoad, t: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in load.records:
        key = f"{r.fate}{'_after_kill' if r.sent >= t else ''}"
        out[key] = out.get(key, 0) + 1
    return out


def replica_kill(target: Target, o) -> Outcome:
    """Kill one engine replica under streaming load: requests not yet streaming must be retried elsewhere."""
    c, out = target.cluster, Outcome()
    n = len(c.actors("EngineReplica"))
    load, t_kill, killed = _under_load(target, o, lambda: c.kill("EngineReplica"))
    replaced = c.wait_replicas("EngineReplica", n, 60, {killed})
    lost = [r for r in load.records if r.fate == "failed_before_token"]
    cut = [r for r in load.records if r.fate == "failed_after_token"]
    out.figures = {"requests": len(load.records), "fates": _fates(load, t_kill), "replaced_after_s": replaced,
                   "cut_streams_with_error_event": sum(r.error_event for r in cut)}
    out.check("0 lost before streaming", not lost, "0 failed requests that had not streamed a token", len(lost))
    out.check("cut streams end cleanly", all(r.error_event for r in cut), "an error event on each", len(cut))
    out.check("replica replaced", replaced is not None, "within 60 s", replaced)
    return out


def ingress_kill(target: Target, o) -> Outcome:
    c, out = target.cluster, Outcome()
    n = len(c.actors("Ingress"))
    load, t_kill, killed = _under_load(target, o, lambda: c.kill("Ingress"))
    back = load.first_ok_after(t_kill)
    out.figures = {"ingress_replicas": n, "fates": _fates(load, t_kill), "served_again_after_s": back,
                   "replaced_after_s": c.wait_replicas("Ingress", n, 60, {killed})}
    out.check("recovered", back is not None and back <= o.recover_s, f"a request served within {o.recover_s:g} s",
              back)
    return out


def controller_kill(target: Target, o) -> Outcome:
    """Kill the tuning controller under load; /metrics must answer 200 within one telemetry window."""
    import ray

    from deployments import controller as controller_mod

    window = float(target.cluster.args.get("controller", {}).get("window_s", 10.0))
    out, seen = Outcome(), []
    with BackgroundLoad(target.url, target.model, o.concurrency, max_s=5 + 3 * window + 30, timeout_s=o.timeout_s):
        time.sleep(5)
        ray.kill(controller_mod.lookup(), no_restart=True)
        t0, ok_at = time.monotonic(), None
        while time.monotonic() - t0 < 3 * window and ok_at is None:
            try:
                codes = (httpx.get(f"{target.url}/metrics", timeout=5).status_code,
                         httpx.get(f"{target.url}/status", timeout=5).status_code)
            except httpx.HTTPError as exc:
                codes = (type(exc).__name__,)
            seen.append(codes)
            ok_at = time.monotonic() - t0 if codes == (200, 200) else None
            time.sleep(0.5)
    out.figures = {"window_s": window, "answers": {str(k): seen.count(k) for k in set(seen)}, "ok_after_s": ok_at}
    out.check("/metrics and /status 200", ok_at is not None and ok_at <= window, f"within {window:g} s", ok_at)
    return out


def _rank_pids(replica_pid: int) -> list[int]:
    import psutil

    kids = psutil.Process(replica_pid).children(recursive=True)
    return [p.pid for p in kids if "spawn_main" in " ".join(p.cmdline())]


def tp_rank_kill(target: Target, o) -> Outcome:
    """SIGKILL one TP rank process of a replica under load: its replica must go down and be replaced."""
    c, out = target.cluster, Outcome()
    victims = c.actors("EngineReplica")
    ranks = _rank_pids(victims[0]["Pid"])
    if not ranks:
        out.check("a TP rank process to kill", False, "rank processes under the replica", 0)
        return out
    load, t_kill, _ = _under_load(target, o, lambda: os.kill(ranks[0], signal.SIGKILL))
    replaced = c.wait_replicas("EngineReplica", len(victims), o.recover_s, {victims[0]["Name"]})
    back = load.first_ok_after(t_kill)
    hangs = [r for r in load.after(t_kill) if r.status == 0 and r.done - r.sent >= o.timeout_s - 1]
    out.figures = {"fates": _fates(load, t_kill), "replaced_after_s": replaced, "served_after_s": back}
    out.check("recovered", replaced is not None and back is not None, f"replica replaced within {o.recover_s:g} s",
              replaced)
    out.check("no hang", not hangs, f"0 requests without an answer in {o.timeout_s:g} s", len(hangs))
    return out


def two_node_failover(target: Target, o) -> Outcome:
    """Kill every process of the worker node under load: the service must serve again within 30 s."""
    import psutil
    import ray

    c, out = target.cluster, Outcome()
    head = ray.get_runtime_context().get_node_id()  # this driver joined the cluster on the head node
    nodes = {a["Address"]["NodeID"] for a in c.actors("EngineReplica")}
    lost = {a["Name"] for a in c.actors("EngineReplica") if a["Address"]["NodeID"] != head}
    procs = [psutil.Process(c.worker.pid), *psutil.Process(c.worker.pid).children(recursive=True)]

    def kill_node():
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        return len(procs)

    load, t_kill, killed = _under_load(target, o, kill_node)
    back = load.first_ok_after(t_kill)
    out.figures = {"replica_nodes_before": len(nodes), "worker_processes_killed": killed, "served_again_after_s": back,
                   "fates": _fates(load, t_kill),
                   "replicas_back_after_s": c.wait_replicas("EngineReplica", int(c.args.get("replicas", 2)), 60, lost)}
    out.check("replicas on both nodes", len(nodes) == 2, "2 nodes", len(nodes))
    out.check("serves again", back is not None and back <= o.recover_s, f"within {o.recover_s:g} s", back)
    return out


def _ray_start(*args: str) -> subprocess.Popen:
    ray_bin = str(Path(sys.executable).with_name("ray"))
    return subprocess.Popen([ray_bin, "start", "--block", "--disable-usage-stats", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen) -> None:
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


@contextmanager
def two_nodes(config: str | Path, overrides: dict, model: str):
    """`ray start --head` and a second `ray start --address` node on this machine, then `serve deploy` of the
    serve config (as an operator runs it; docs/serving.md, "Running on several machines") with `overrides`
    merged into its app args, the proxy on the head only (two proxies on one machine would want one port) and
    replicas reserving a whole CPU, so that Serve spreads them over both nodes."""
    import ray
    from ray import serve

    gcs, dashboard, port = free_port(True), free_port(True), free_port(True)
    stack = ExitStack()
    stack.enter_context(_cluster_token())
    head = _ray_start("--head", f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true",
                      "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}")
    worker, cfg = None, merge(app_args(config, overrides), {"replica_cpus": 1.0})
    try:
        _wait_port(gcs, 60)
        worker = _ray_start(f"--address=127.0.0.1:{gcs}", "--num-cpus=2")
        ray.init(address=f"127.0.0.1:{gcs}", log_to_driver=False)
        deadline = time.monotonic() + 60
        while sum(n["Alive"] for n in ray.nodes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        deployed = _deploy_config(config, cfg, port)
        _wait_port(dashboard, 60)
        subprocess.run([str(Path(sys.executable).with_name("serve")), "deploy", str(deployed),
                        "--address", f"http://127.0.0.1:{dashboard}"], check=True, timeout=120,
                       stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 180, poll_s=1.0)
        yield Target(url, model, cluster=Cluster(cfg, worker))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for p in (worker, head):
                if p is not None:
                    _stop(p)
            stack.close()


@contextmanager
def _cluster_token():
    """Ray's token authentication, as a multi-machine cluster runs it: one token for the head, the worker node,
    the `serve` CLI and this driver (RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, inherited by the processes started
    here). Set explicitly because Ray otherwise decides per process from ~/.ray/auth_token, which a driver that
    joins an existing cluster by address does not read: with a token file on the machine the head required a
    token and `ray.init` failed. The driver's cached auth state is refreshed on entry and exit (as Ray's own
    tests do), since earlier local clusters of the suite cached theirs."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    from ray._raylet import AuthenticationTokenLoader, Config

    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    saved = {k: os.environ.get(k) for k in keys}

    def refresh():
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=generate_new_authentication_token())
    refresh()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        refresh()


def _deploy_config(config: str | Path, args: dict, port: int) -> Path:
    """The serve config file `serve deploy` gets: `config` with the app's `args` replaced, its proxy on the head
    only and on `port`; written next to nothing the repo tracks (a temporary file)."""
    spec = yaml.safe_load(Path(config).read_text())
    spec["proxy_location"] = "HeadOnly"
    spec["http_options"] = {"host": "127.0.0.1", "port": port}
    spec["applications"][0]["args"] = args
    out = Path(tempfile.mkdtemp(prefix="dasc-two-node-")) / "config.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out



def _wait_port(port: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port} after {within_s:g} s")
