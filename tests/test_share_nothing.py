"""Hosts that share nothing: 2 processes of a run, each in its own network and mount namespace, with ``--ckpt-local``.

Each "host" is a network namespace (a veth pair between the two, one subnet, process 0's coordination service on
its side's address) and a mount namespace with a private tmpfs over the same path, which holds that host's run
directory (store and checkpoints): the other host's process cannot see it. An uninterrupted run gives the
reference; then a run whose process 1 is killed inside a step's update (``NSP_DEBUG_KILL_AFTER_WRITES``: SIGKILL
at a page write) and ``--resume`` on both hosts must end bit for bit where the reference ended: each host's copy
of the train state, and the optimizer state in the two hosts' stores. The test is skipped, with the reason, where
the machine refuses namespaces (not root, no ``ip``/``unshare``/``nsenter``, or creating them fails).
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

NSP = [sys.executable, "-m", "nsp.cli"]
REPO = Path(__file__).resolve().parents[1]
DATA = str(REPO / "nsp" / "train" / "corpus.py")
STEPS = 10  # the configuration of tests/test_distributed.py, whose compiled steps the cache then holds
TRAIN = ["train", "--model", "tiny", "--steps", str(STEPS), "--batch", "4", "--seq", "32", "--log-every", "1",
         "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "4", "--page-mib", "0.0625", "--data", DATA,
         "--ckpt-local"]
# Process 1's file backends count page writes per shard (6 a step each, after the 6 of the initial state):
# SIGKILL at its 39th, inside step 6's update, after the checkpoint of step 4.
KILL_AFTER_WRITES = 38
PORT = 47613


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


class Hosts:
    """Two namespaced hosts; ``run(i, args)`` starts ``nsp`` on host ``i``; ``path(i, p)`` reads its private
    ``p`` from outside (through ``/proc/PID/root``)."""

    def __init__(self, root: Path):
        tag = f"{os.getpid() % 100000}"
        self.root = root  # the same path on both hosts: a private tmpfs on each
        self.netns = [f"nspsn{tag}-{i}" for i in range(2)]
        self.veth = [f"nspv{tag}a", f"nspv{tag}b"]
        subnet = 10 + os.getpid() % 200
        self.addr = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]
        self.holders: list[subprocess.Popen] = []
        self.pids: list[int] = []

    def up(self) -> str | None:
        """Makes the namespaces, the link and the private mounts; returns why not, or None."""
        for ns in self.netns:
            if (done := _sh("ip", "netns", "add", ns)).returncode:
                return f"ip netns add: {done.stderr.strip()}"
        steps = [("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])]
        for i in range(2):
            steps += [("ip", "link", "set", self.veth[i], "netns", self.netns[i]),
                      ("ip", "-n", self.netns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.veth[i]),
                      ("ip", "-n", self.netns[i], "link", "set", self.veth[i], "up"),
                      ("ip", "-n", self.netns[i], "link", "set", "lo", "up")]
        for cmd in steps:
            if (done := _sh(*cmd)).returncode:
                return f"{' '.join(cmd)}: {done.stderr.strip()}"
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(2):  # a process that holds host i's mount namespace (its tmpfs) between the runs
            # Its own host name and /etc/hosts, as a real host has: JAX's CPU collectives (Gloo) announce the
            # address the host name resolves to.
            hosts_file = f"{self.root}/.etc-hosts"
            script = (f"mount -t tmpfs -o size=256m nsp-host-{i} '{self.root}' && hostname nsp-host-{i} && "
                      f"printf '127.0.0.1 localhost\\n{self.addr[i]} nsp-host-{i}\\n' > '{hosts_file}' && "
                      f"mount --bind '{hosts_file}' /etc/hosts && echo $$ && exec sleep 3600")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", self.netns[i], "unshare", "--mount", "--uts", "--propagation", "private",
                 "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.holders.append(holder)
            line = holder.stdout.readline().strip()
            if not line.isdigit():
                return f"a private mount namespace: {holder.stderr.read().strip() or 'the holder exited'}"
            self.pids.append(int(line))
        return None

    def down(self) -> None:
        for holder in self.holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
        for ns in self.netns:
            _sh("ip", "netns", "del", ns)  # takes the veth end inside it, and so the pair
        _sh("ip", "link", "del", self.veth[0])  # left outside when set-up stopped early

    def run(self, i: int, args: list[str], env: dict | None = None, port: int = PORT) -> subprocess.Popen:
        cmd = ["nsenter", "-t", str(self.pids[i]), "-m", "-n", "-u", f"--wd={REPO}", "--"] + NSP + args + [
            "--coordinator", f"{self.addr[0]}:{port}", "--num-processes", "2", "--process-id", str(i)]
        penv = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or "CACHE" in k}
        penv.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONUNBUFFERED="1", **(env or {}))
        return subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def path(self, i: int, p: Path) -> Path:
        return Path(f"/proc/{self.pids[i]}/root") / Path(p).relative_to("/")


@pytest.fixture
def hosts(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network and mount namespaces need root")
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} on this machine")
    h = Hosts(tmp_path / "host")
    try:
        why = h.up()
        if why is not None:
            pytest.skip(f"the machine refuses the namespaces: {why}")
        yield h
    finally:
        h.down()


def _start(h: Hosts, args: list[str], kill_1: bool = False, port: int = PORT) -> list[subprocess.Popen]:
    """Starts ``nsp`` on both hosts (process 1 to be killed inside an update with ``kill_1``)."""
    return [h.run(i, args, {"NSP_DEBUG_KILL_AFTER_WRITES": str(KILL_AFTER_WRITES)} if kill_1 and i else None, port)
            for i in range(2)]


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each process's exit status and output."""
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, text))
    return out


def _said(results: list[tuple[int, str]]) -> str:
    return "\n".join(f"host {i} (exit status {status}):\n{out}" for i, (status, out) in enumerate(results))


def _state(h: Hosts, run_dir: Path) -> dict:
    """Each host's copy of the final params (its newest checkpoint) and the store states over both hosts."""
    import jax

    import nsp.storage
    from nsp.storage import checkpoint as ckpt

    out = {}
    for i in range(2):
        ckpt_dir = h.path(i, run_dir / "ckpt")
        step = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
        assert step == STEPS
        for k, x in enumerate(jax.tree_util.tree_leaves(ckpt.load_train_state(ckpt_dir / str(step)))):
            out[f"host{i}/params/{k}"] = np.asarray(x)
    for state in ("param", "mu", "nu"):
        chunks = []
        for i in range(2):
            shards = [2 * i, 2 * i + 1]
            with nsp.storage.open(h.path(i, run_dir / "store" / f"process-{i:05d}"), shards=shards) as store:
                chunks += [store.read_shard(state, s) for s in shards]
        out[state] = np.concatenate(chunks)
    return out


def test_share_nothing_hosts_resume_a_killed_run_bit_exactly(hosts):
    ref, run = hosts.root / "reference", hosts.root / "run"
    # The uninterrupted run and the one to be killed at once (each its own coordinator port): less waiting.
    started = _start(hosts, TRAIN + ["--run-dir", str(ref)]), _start(hosts, TRAIN + ["--run-dir", str(run)],
                                                                      kill_1=True, port=PORT + 1)
    reference, killed = _wait(started[0]), _wait(started[1])
    assert [status for status, _ in reference] == [0, 0], _said(reference)
    # Each host holds its own complete checkpoints, and nothing of the other's.
    for i in range(2):
        step = hosts.path(i, ref / "ckpt" / str(STEPS))
        assert (step / "train_state").is_dir() and (step / "meta").is_dir()
        assert [p.name for p in (step / "store").iterdir() if p.is_dir()] == [f"process-{i:05d}"]
        assert not hosts.path(1 - i, ref / "store" / f"process-{i:05d}").exists()

    assert killed[1][0] == -signal.SIGKILL, killed[1][1]  # killed inside step 6's update
    assert "step     5/" in killed[1][1] and "step     6/" not in killed[1][1], killed[1][1]
    assert killed[0][0] != 0, killed[0][1]  # its peer stopped too
    for i in range(2):
        assert sorted(int(p.name) for p in hosts.path(i, run / "ckpt").iterdir() if p.name.isdigit()) == [0, 4]

    resumed = _wait(_start(hosts, TRAIN + ["--run-dir", str(run), "--resume"]))
    assert [status for status, _ in resumed] == [0, 0], _said(resumed)
    for status, out in resumed:
        assert f"resumed {run} at step 4" in out, out
    a, b = _state(hosts, ref), _state(hosts, run)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    n = len([k for k in a if k.startswith("host0/")])
    for k in range(n):  # the two hosts' copies of the train state are the same
        np.testing.assert_array_equal(a[f"host0/params/{k}"], a[f"host1/params/{k}"])
