#!/usr/bin/env python3
"""idemgate against nginx, side by side on one machine.

Starts a trivial backend (nginx answering 201), nginx as a plain
pass-through reverse proxy (upstream keepalive on) and idemgate on each
store, every one on its own loopback port, then runs interleaved rounds of
wrk (nginx, idemgate, nginx, idemgate, ...) so drift hits both alike.
Reports requests/s, p50/p99 latency and CPU time per request of each side,
and the ratios of the medians (and of each pair of rounds), as a Markdown
table.

Needs: wrk, nginx, redis-server (Debian packages) and a release build
(`cargo build --release`). Only loopback addresses are used.

    python3 bench/run.py                       # every scenario, 3 rounds of 10 s
    python3 bench/run.py --rounds 5 --duration 15 --scenarios memory-new,redis-new
    python3 bench/run.py --workers 4           # idemgate with server.workers = 4
    python3 bench/run.py --binary target/pgo/x86_64-unknown-linux-gnu/release/idemgate   # bench/pgo.py's build
    python3 bench/run.py --scenarios redis-new,copied-new   # Redis, and Redis with store.wait_for_replicas = 1

`copied-new` (not run by default) is `redis-new` on a Redis with one
replica and `store.wait_for_replicas = 1`: what the replica's copy of each
claim and answer costs.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "idemgate")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def cpu_seconds(pids):
    """User + system CPU time of the processes and their threads."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / CLK_TCK


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    except OSError:
        return []


NGINX_CONF = """
worker_processes {workers};
pid {dir}/nginx-{name}.pid;
error_log {dir}/nginx-{name}.err warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    {body}
}}
"""

BACKEND = """
    server {{
        listen 127.0.0.1:{port};
        location / {{
            default_type application/json;
            return 201 '{{"ok":true}}';
        }}
    }}
"""

# `reuseport`: a listening socket per worker, so the kernel spreads the
# connections over nginx's workers as it does over idemgate's. Without it,
# whichever worker wakes first takes a whole burst of wrk's connections: in
# 4 s runs by hand all 64 landed on one worker in two runs of three, and
# nginx's rate moved between 38k and 55k req/s from round to round.
PASS_THROUGH = """
    upstream backend {{
        server 127.0.0.1:{backend};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} reuseport;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
"""

IDEMGATE = """
[server]
listen = "127.0.0.1:{port}"
admin_listen = ""
{server_extra}
[upstream]
url = "http://127.0.0.1:{backend}"
[store]
backend = "{store}"
{store_extra}
[[route]]
name = "bench"
path = "/bench"
"""

# One new key per request: thread id, a per-thread counter, and the time.
NEW_KEYS = """
local counter = 0
local prefix = ""
function setup(thread)
  thread:set("tid", tostring(math.random(1, 1e9)))
end
function init(args)
  prefix = tid .. "-" .. tostring(os.time()) .. "-"
end
function request()
  counter = counter + 1
  return wrk.format("POST", "/bench", {["Idempotency-Key"] = prefix .. counter, ["Content-Type"] = "application/json"}, '{"sku":42}')
end
"""

# New keys at a paced rate: each connection waits between requests, so both
# proxies see the same offered load and their p99 can be compared.
PACED = NEW_KEYS + """
function delay()
  return {pause_ms}
end
"""

# A small pool of keys, replayed over and over.
REPLAYS = """
local counter = 0
function request()
  counter = counter + 1
  return wrk.format("POST", "/bench", {["Idempotency-Key"] = "replay-" .. (counter % 64), ["Content-Type"] = "application/json"}, '{"sku":42}')
end
"""


class Processes:
    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self):
        for p in reversed(self.procs):
            self.stop(p)


def nginx(procs, tmp, name, body, workers):
    conf = os.path.join(tmp, f"nginx-{name}.conf")
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(dir=tmp, name=name, body=body, workers=workers))
    return procs.start(["nginx", "-c", conf, "-p", tmp])


def require_tools():
    for tool in ("wrk", "nginx", "redis-server"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: apt-get install wrk nginx redis-server")


def require_binary(path):
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: build first (cargo build --release, or python3 bench/pgo.py)")


def redis_server(procs):
    """A redis-server of our own, keeping nothing on disk; returns its port and pid."""
    port = free_port()
    server = procs.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                          "no"])
    wait_port(port)
    return port, server.pid


def replica_of(procs, tmp, port):
    """A redis-server replicating the one on `port`, counted by its `WAIT`
    (acknowledged once), its copy of the data in `tmp`; returns its pid."""
    subprocess.run(["redis-cli", "-p", str(port), "config", "set", "repl-diskless-sync-delay", "0"],
                   capture_output=True, check=True)
    replica_port = free_port()
    replica = procs.start(["redis-server", "--port", str(replica_port), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--replicaof", "127.0.0.1", str(port), "--dir", tmp])
    wait_port(replica_port)
    deadline = time.time() + 30
    while True:
        out = subprocess.run(["redis-cli", "-p", str(port)], input="SET bench-copied 1\nWAIT 1 100\n",
                             capture_output=True, text=True).stdout
        if out.strip().endswith("1"):
            return replica.pid
        if time.time() > deadline:
            sys.exit("the replica never acknowledged a write")
        time.sleep(0.2)


def lua_scripts(tmp, texts):
    """Writes wrk's scripts, (name, text) pairs, to `tmp`; returns their paths by name."""
    scripts = {}
    for name, text in texts:
        scripts[name] = os.path.join(tmp, f"{name}.lua")
        with open(scripts[name], "w") as f:
            f.write(text)
    return scripts


def wrk(port, script, duration, connections, threads, cpus=None):
    """One wrk run; on `cpus` only, when given."""
    out = subprocess.run(
        ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration}s", "--latency", "-s", script,
         f"http://127.0.0.1:{port}/bench"],
        capture_output=True, text=True, check=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    lat = {}
    for pct in ("50", "99"):
        m = re.search(rf"\s{pct}(?:\.000)?%\s+([\d.]+)(us|ms|s)", out)
        value, unit = float(m.group(1)), m.group(2)
        lat[pct] = value * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(non2xx.group(1)) if non2xx else 0
    return {"rps": rps, "p50": lat["50"], "p99": lat["99"], "requests": total, "non2xx": errors}


def measure(port, pids, script, args, store_pids=()):
    """One wrk run against `port`: its figures, and the CPU time per request
    of `pids` (`cpu_us`) and of `store_pids` (`store_cpu_us`)."""
    before, store_before = cpu_seconds(pids), cpu_seconds(store_pids)
    result = wrk(port, script, args.duration, args.connections, args.threads)
    after, store_after = cpu_seconds(pids), cpu_seconds(store_pids)
    requests = max(result["requests"], 1)
    result["cpu_us"] = (after - before) / requests * 1e6
    result["store_cpu_us"] = (store_after - store_before) / requests * 1e6
    return result


def server_extra(args):
    """The `[server]` lines the command line asks for."""
    return f"workers = {args.workers}" if args.workers else ""


def pin(pids, cpus):
    """Puts every thread of the processes on `cpus`."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass


def one_connection(procs, tmp, backend_port, nginx_port, script, args, backend_pids, nginx_pids):
    """Median p50s over the rounds at one connection: direct, nginx, idemgate.

    At one connection a request is a chain of wake-ups across processes,
    and on a VM a wake-up on the other core costs tens of µs: where the
    scheduler happens to place wrk, the proxy and the backend decides more
    of the latency than the proxy's own work, and it changes placement
    between runs. So besides the unpinned runs, each round also runs with
    the placement fixed, the same for both proxies: wrk on the first core,
    the proxy and the backend on the last. Returns both sets of medians
    (the pinned one `None` on one core).
    """
    port = free_port()
    conf = os.path.join(tmp, "idemgate-latency.toml")
    with open(conf, "w") as f:
        f.write(IDEMGATE.format(port=port, backend=backend_port, store="memory", store_extra='max_memory = "64MiB"',
                                server_extra=server_extra(args)))
    gate = procs.start([args.binary, "--config", conf], env={**os.environ, "RUST_LOG": "warn"})
    wait_port(port)
    servers = backend_pids + nginx_pids + [gate.pid]
    every = os.sched_getaffinity(0)
    placements = [None] + ([({min(every)}, {max(every)})] if len(every) > 1 else [])
    results = {(p is None, name): [] for p in placements for name in ("direct", "nginx", "idemgate")}
    try:
        for _ in range(args.rounds):
            for placement in placements:
                client = None
                if placement:
                    client, server = placement
                    pin(servers, server)
                for name, target in (("direct", backend_port), ("nginx", nginx_port), ("idemgate", port)):
                    results[(placement is None, name)].append(wrk(target, script, args.duration, 1, 1, client)["p50"])
                pin(servers, every)
    finally:
        pin(servers, every)
    procs.stop(gate)
    medians = lambda free: tuple(statistics.median(results[(free, k)]) for k in ("direct", "nginx", "idemgate"))
    return medians(True), medians(False) if len(placements) > 1 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--workers", type=int, help="idemgate's server.workers (default: its own default)")
    parser.add_argument("--binary", default=BINARY, help="the idemgate to run (default: target/release/idemgate)")
    parser.add_argument("--scenarios",
                        default="memory-new,memory-replay,memory-paced,redis-new,embedded-new,memory1m-new,"
                                "latency-1conn")
    args = parser.parse_args()
    require_tools()
    require_binary(args.binary)

    tmp = tempfile.mkdtemp(prefix="idemgate-bench-")
    procs = Processes()
    try:
        backend_port, nginx_port = free_port(), free_port()
        backend = nginx(procs, tmp, "backend", BACKEND.format(port=backend_port), 1)
        pass_through = nginx(procs, tmp, "proxy", PASS_THROUGH.format(port=nginx_port, backend=backend_port), "auto")
        wait_port(backend_port)
        wait_port(nginx_port)
        nginx_pids = [pass_through.pid] + children(pass_through.pid)
        backend_pids = [backend.pid] + children(backend.pid)

        # 64 connections, each pausing this long: about 20k req/s offered.
        pause = args.connections * 1000 / 20000
        scripts = lua_scripts(tmp, (("new", NEW_KEYS), ("replay", REPLAYS),
                                    ("paced", PACED.replace("{pause_ms}", f"{pause:.2f}"))))
        redis_port, redis_pid = redis_server(procs)
        replica_pid = None

        rows = []
        latency = None
        for scenario in args.scenarios.split(","):
            store, kind = scenario.split("-")
            if store == "latency":
                latency = one_connection(procs, tmp, backend_port, nginx_port, scripts["new"], args, backend_pids,
                                         nginx_pids)
                continue
            extra = {
                # Small enough that a run must evict: the store holds its budget.
                "memory": 'max_memory = "64MiB"',
                # Room for a million records (~1.15 KB each as the store
                # counts them): the prefill fills it, and the measured runs
                # evict the oldest, as memory-new does at 64 MiB. So the two
                # differ only in how many records they hold, not in one
                # growing (page faults, table resizes) and the other not.
                "memory1m": 'max_memory = "1280MiB"',
                "redis": f'url = "redis://127.0.0.1:{redis_port}/0"',
                "copied": f'url = "redis://127.0.0.1:{redis_port}/0"\nwait_for_replicas = 1',
                "embedded": f'path = "{tmp}/bench-{time.time_ns()}.redb"',
            }[store]
            if store == "copied" and replica_pid is None:
                replica_pid = replica_of(procs, tmp, redis_port)
            port = free_port()
            conf = os.path.join(tmp, f"idemgate-{scenario}.toml")
            with open(conf, "w") as f:
                f.write(IDEMGATE.format(port=port, backend=backend_port,
                                        store={"memory1m": "memory", "copied": "redis"}.get(store, store),
                                        server_extra=server_extra(args),
                                        store_extra=extra))
            gate = procs.start([args.binary, "--config", conf], env={**os.environ, "RUST_LOG": "warn"})
            wait_port(port)
            script = scripts[kind]
            if store == "memory1m":
                # Store a million records first: throughput must not depend on it.
                stored = 0
                while stored < 1_000_000:
                    stored += wrk(port, scripts["new"], 5, args.connections, args.threads)["requests"]
                print(f"  {scenario}: {stored} records stored", file=sys.stderr)
            # Warm both up (and fill the replay pool).
            wrk(port, script, 2, args.connections, args.threads)
            wrk(nginx_port, script, 2, args.connections, args.threads)
            ours, theirs = [], []
            for _ in range(args.rounds):
                theirs.append(measure(nginx_port, nginx_pids, script, args))
                redis_pids = {"redis": [redis_pid], "copied": [redis_pid, replica_pid]}.get(store, [])
                ours.append(measure(port, [gate.pid], script, args, redis_pids))
                print(f"  {scenario}: nginx {theirs[-1]['rps']:.0f} req/s, idemgate {ours[-1]['rps']:.0f} req/s",
                      file=sys.stderr)
            rss = peak_rss_mib(gate.pid)
            procs.stop(gate)
            med = lambda runs, k: statistics.median(r[k] for r in runs)
            ours_median = {k: med(ours, k) for k in ours[0]}
            ours_median["rss"] = rss
            # Each idemgate round over the nginx round just before it: on a
            # host whose speed drifts between rounds, the spread says how
            # far to trust the ratio of the medians.
            ours_median["rounds"] = sorted(o["rps"] / t["rps"] for o, t in zip(ours, theirs))
            rows.append((scenario, {k: med(theirs, k) for k in theirs[0]}, ours_median))

        print(f"\n{os.path.relpath(args.binary, ROOT)}: {args.rounds} interleaved rounds of {args.duration} s, "
              f"{args.connections} connections, {args.threads} wrk threads, {os.cpu_count()} cores; medians.\n")
        print("| scenario | nginx req/s | idemgate req/s | ratio | round by round: median (range) "
              "| nginx p50 / p99 ms | idemgate p50 / p99 ms "
              "| nginx CPU µs/req | idemgate CPU µs/req | idemgate peak RSS MiB | idemgate non-2xx |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for scenario, n, i in rows:
            rounds = i["rounds"]
            print(f"| {scenario} | {n['rps']:.0f} | {i['rps']:.0f} | {i['rps'] / n['rps']:.2f}× "
                  f"| {statistics.median(rounds):.2f}× ({rounds[0]:.2f}–{rounds[-1]:.2f}) "
                  f"| {n['p50']:.2f} / {n['p99']:.2f} | {i['p50']:.2f} / {i['p99']:.2f} "
                  f"| {n['cpu_us']:.1f} | {i['cpu_us']:.1f} | {i['rss']:.0f} | {i['non2xx']:.0f} |")
        for scenario, n, i in rows:
            # The table's CPU column is idemgate's own; on Redis the store's
            # server works for each request too, on the same two cores.
            if scenario.startswith(("redis", "copied")):
                servers = "redis-server and its replica" if scenario.startswith("copied") else "redis-server"
                print(f"\n{scenario}: {servers} spent {i['store_cpu_us']:.1f} µs of CPU per request besides "
                      f"idemgate's {i['cpu_us']:.1f} ({i['cpu_us'] + i['store_cpu_us']:.1f} in all, against "
                      f"nginx's {n['cpu_us']:.1f}).")
        if latency:
            for label, medians in zip(("placed by the scheduler", "wrk on one core, proxy and backend on the other"),
                                      latency):
                if medians is None:
                    continue
                direct, through_nginx, through_gate = (m * 1000 for m in medians)
                print(f"\nOne connection, new keys, p50 latency ({label}): backend direct {direct:.0f} µs, "
                      f"through nginx {through_nginx:.0f} µs (+{through_nginx - direct:.0f}), "
                      f"through idemgate (memory store) {through_gate:.0f} µs (+{through_gate - direct:.0f}).")
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
