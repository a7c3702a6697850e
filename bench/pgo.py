#!/usr/bin/env python3
"""A profile-guided (PGO) release build of idemgate.

Builds idemgate instrumented, runs it on each store (memory, Redis,
embedded) in front of the benchmark's trivial backend while wrk sends new
keys, replays and reused keys at 64 connections and at one, merges the
profiles, and builds again with them: the compiler then lays out and
inlines the code for the paths a gateway actually runs. The result is
`target/pgo/<host>/release/idemgate`; `python3 bench/run.py --binary
<that path>` benchmarks it. The plain `cargo build --release` is untouched.

Needs: wrk, nginx, redis-server, and the `llvm-profdata` of the LLVM that
rustc is built on (`rustc -vV` names it): rustup's `rustup component add
llvm-tools` ships it beside rustc (Debian's archive has no LLVM as new as
rustc's); an `llvm-profdata-<major>` or `llvm-profdata` on the PATH of that
major version does as well. Only loopback addresses are used.

    python3 bench/pgo.py
"""

import argparse
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (the benchmark's backend, configs and helpers)

# 17 keys and two bodies: a key comes back with the other body every other
# time (17 is odd), so most requests are refused with 422.
REUSED = """
local counter = 0
function request()
  counter = counter + 1
  return wrk.format("POST", "/bench", {["Idempotency-Key"] = "reused-" .. (counter % 17), ["Content-Type"] = "application/json"}, '{"sku":' .. (counter % 2) .. '}')
end
"""


@functools.cache
def rustc_version():
    return subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout


def llvm_profdata():
    """The llvm-profdata that reads what this rustc's LLVM writes."""
    major = re.search(r"LLVM version: (\d+)", rustc_version()).group(1)
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True,
                             check=True).stdout.strip()
    # Where rustup's llvm-tools component puts it, then the PATH.
    candidates = [os.path.join(sysroot, "lib", "rustlib", host(), "bin", "llvm-profdata")]
    candidates += [shutil.which(tool) for tool in (f"llvm-profdata-{major}", "llvm-profdata")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            if re.search(rf"LLVM version {major}\.", out):
                return path
    sys.exit(f"no llvm-profdata of LLVM {major} (rustc's): rustup component add llvm-tools")


def host():
    return re.search(r"host: (\S+)", rustc_version()).group(1)


def build(target_dir, flag):
    # With an explicit --target, the flag reaches idemgate and its
    # dependencies but not build scripts and proc macros. Given as
    # CARGO_ENCODED_RUSTFLAGS, which takes precedence over RUSTFLAGS and is
    # not split at spaces (in the path).
    env = {k: v for k, v in os.environ.items() if k not in ("RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS")}
    subprocess.run(["cargo", "build", "--release", "--locked", "--bin", "idemgate", "--target", host(),
                    "--target-dir", target_dir],
                   cwd=bench.ROOT, env={**env, "CARGO_ENCODED_RUSTFLAGS": flag}, check=True)
    return os.path.join(target_dir, host(), "release", "idemgate")


def train(binary, profiles, tmp):
    """Runs the instrumented binary on every store under load."""
    procs = bench.Processes()
    try:
        backend_port = bench.free_port()
        bench.nginx(procs, tmp, "backend", bench.BACKEND.format(port=backend_port), 1)
        bench.wait_port(backend_port)
        redis_port, _ = bench.redis_server(procs)
        scripts = bench.lua_scripts(tmp, (("new", bench.NEW_KEYS), ("replay", bench.REPLAYS), ("reused", REUSED)))
        stores = {
            "memory": 'max_memory = "16MiB"',
            "redis": f'url = "redis://127.0.0.1:{redis_port}/0"',
            "embedded": f'path = "{tmp}/pgo-{time.time_ns()}.redb"',
        }
        for store, extra in stores.items():
            port = bench.free_port()
            conf = os.path.join(tmp, f"idemgate-{store}.toml")
            with open(conf, "w") as f:
                f.write(bench.IDEMGATE.format(port=port, backend=backend_port, store=store,
                                              server_extra='shutdown_grace = "2s"',
                                              store_extra=extra))
            gate = procs.start([binary, "--config", conf],
                               env={**os.environ, "RUST_LOG": "warn",
                                    "LLVM_PROFILE_FILE": os.path.join(profiles, f"{store}-%p.profraw")})
            bench.wait_port(port)
            for script, seconds, connections, threads in (("new", 6, 64, 2), ("replay", 3, 64, 2),
                                                          ("reused", 2, 64, 2), ("new", 2, 1, 1)):
                bench.wrk(port, scripts[script], seconds, connections, threads)
            # Only a clean exit writes the profile.
            procs.stop(gate)
            if gate.returncode != 0 or not glob.glob(os.path.join(profiles, f"{store}-*.profraw")):
                sys.exit(f"idemgate on the {store} store exited with {gate.returncode} and no profile")
            print(f"  trained on the {store} store", file=sys.stderr)
    finally:
        procs.stop_all()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    bench.require_tools()
    profdata = llvm_profdata()
    tmp = tempfile.mkdtemp(prefix="idemgate-pgo-")
    try:
        # A fixed directory, so an unchanged instrumented build is reused.
        profiles = os.path.join(bench.ROOT, "target", "pgo-profiles")
        shutil.rmtree(profiles, ignore_errors=True)
        os.makedirs(profiles)
        instrumented = build(os.path.join(bench.ROOT, "target", "pgo-generate"), f"-Cprofile-generate={profiles}")
        train(instrumented, profiles, tmp)
        raw = glob.glob(os.path.join(profiles, "*.profraw"))
        merged = os.path.join(profiles, "merged.profdata")
        subprocess.run([profdata, "merge", "-o", merged] + raw, check=True)
        # Cargo does not track the profile's content, only the flags: a
        # name after the content makes a new profile a new build.
        with open(merged, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        merged = shutil.move(merged, os.path.join(bench.ROOT, "target", f"pgo-{digest}.profdata"))
        binary = build(os.path.join(bench.ROOT, "target", "pgo"), f"-Cprofile-use={merged}")
        print(f"\n{binary}\n\nbenchmark it: python3 bench/run.py --binary {os.path.relpath(binary, os.getcwd())}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
