#!/usr/bin/env python3
"""Instructions per request, idemgate against nginx, under callgrind.

Wall-clock figures on a shared 2-core machine move ±10% between runs;
instruction counts do not. This runs nginx as a pass-through proxy, and
idemgate on the memory store (or with `--store redis`, on a redis-server
of its own, which runs natively: only idemgate's instructions are
counted), each under `valgrind --tool=callgrind` in
front of the same trivial backend, sends POSTs with new keys through each
(wrk, 16 connections), and divides the instructions executed while wrk ran
by the requests it made. The counts are user-space only (no kernel time)
and repeat to within about 1%. SHA-256 runs in software under valgrind
(no SHA extensions), so idemgate's count overstates its fingerprinting by
about 12k instructions per request.

Needs: valgrind, wrk, nginx (and redis-server for `--store redis`) and a
release build (`cargo build --release`).

    python3 bench/instructions.py
    python3 bench/instructions.py --store redis
    python3 bench/instructions.py --binary target/pgo/x86_64-unknown-linux-gnu/release/idemgate
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (the benchmark's backend, configs and helpers)


def instructions(procs, tmp, name, command, port, script):
    """Instructions per request of `command` (listening on `port`) under callgrind."""
    out = os.path.join(tmp, f"callgrind-{name}")
    proc = procs.start(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"] + command,
                       env={**os.environ, "RUST_LOG": "warn"})
    bench.wait_port(port, timeout=60)
    # Warm up (connections, pools, caches) before counting.
    bench.wrk(port, script, 2, 16, 1)
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
    requests = bench.wrk(port, script, 6, 16, 1)["requests"]
    subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True, check=True)
    proc.kill()
    proc.wait()
    total = 0
    for dump in glob.glob(out + "*"):
        with open(dump) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    total = max(total, int(line.split()[1]))
    return total / max(requests, 1), requests


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default=bench.BINARY, help="the idemgate to run (default: target/release/idemgate)")
    parser.add_argument("--store", default="memory", choices=("memory", "redis"), help="idemgate's store")
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "wrk", "nginx") + (("redis-server",) if args.store == "redis" else ()):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: apt-get install valgrind wrk nginx")
    bench.require_binary(args.binary)
    tmp = tempfile.mkdtemp(prefix="idemgate-instructions-")
    procs = bench.Processes()
    try:
        backend_port, nginx_port, gate_port = bench.free_port(), bench.free_port(), bench.free_port()
        bench.nginx(procs, tmp, "backend", bench.BACKEND.format(port=backend_port), 1)
        bench.wait_port(backend_port)
        script = bench.lua_scripts(tmp, [("new", bench.NEW_KEYS)])["new"]

        # One nginx worker in the foreground process, so callgrind sees it.
        conf = os.path.join(tmp, "nginx-proxy.conf")
        with open(conf, "w") as f:
            f.write(bench.NGINX_CONF.format(dir=tmp, name="proxy", workers="1; master_process off",
                                            body=bench.PASS_THROUGH.format(port=nginx_port, backend=backend_port)))
        nginx_ir, nginx_n = instructions(procs, tmp, "nginx", ["nginx", "-c", conf, "-p", tmp], nginx_port, script)

        conf = os.path.join(tmp, "idemgate.toml")
        if args.store == "redis":
            store_extra = f'url = "redis://127.0.0.1:{bench.redis_server(procs)[0]}/0"'
        else:
            store_extra = 'max_memory = "64MiB"'
        with open(conf, "w") as f:
            f.write(bench.IDEMGATE.format(port=gate_port, backend=backend_port, store=args.store,
                                          store_extra=store_extra, server_extra=""))
        gate_ir, gate_n = instructions(procs, tmp, "idemgate", [args.binary, "--config", conf], gate_port, script)

        print("| proxy | requests counted | instructions per request |")
        print("|---|---|---|")
        print(f"| nginx pass-through | {nginx_n} | {nginx_ir:,.0f} |")
        print(f"| idemgate, {args.store} store, new keys | {gate_n} | {gate_ir:,.0f} |")
        print(f"\nidemgate / nginx: {gate_ir / nginx_ir:.2f}×")
    finally:
        procs.stop_all()
        time.sleep(0.2)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
