"""Multi-node under torchrun: two "nodes" on this host train as one node of the same world does.

`examples/multinode_check.py` trains gpt-tiny on batches that depend only on the step and the
global rank, so one node of three ranks and two nodes of one and two ranks must report the same
losses. Each node is its own torchrun, rendezvousing on 127.0.0.1; the ranks record their
RANK, LOCAL_RANK, GROUP_RANK, what the engine made of them and fxzero's transport.

Two rendezvous backends, because they differ in who is node 0:
- static (`--master_addr/--master_port`): `--node_rank` is the GROUP_RANK;
- c10d (`--rdzv_endpoint`): torchrun ignores `--node_rank` and numbers the nodes in sorted
  order of their (host, torchrun pid), so here the node with one rank is usually, not surely, 0.

Both torchruns of this host are one host to fxzero, which shares memory between ranks that
report the same host id (`fxzero/runtime/comm/shm.py`): the transport must not change.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "multinode_check.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCH_TIMEOUT_S = 240
"""Every torchrun of one launch must have finished by then; a rendezvous that hangs is killed."""
STOP_GRACE_S = 30
"""How long a torchrun told to stop may take to stop its workers."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _excerpt(path, lines: int = 30) -> str:
    """A worker's first traceback in a torchrun log (torchrun's own summary omits it), else the tail."""
    with open(path, errors="replace") as f:
        text = f.readlines()
    start = next((i for i, line in enumerate(text) if line.startswith("Traceback")), None)
    if start is None:
        return "".join(text[-lines:])
    end = next((i for i in range(start + 1, len(text)) if not text[i].startswith((" ", "\t"))), len(text) - 1)
    return "".join(text[start : end + 1])


def _stop(procs: list[subprocess.Popen]) -> None:
    """End torchruns still running: SIGTERM first, which torchrun passes on to its workers (they
    run in sessions of their own, out of reach of a signal to torchrun's group), then SIGKILL."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # its group: it leads one (start_new_session)
    except ProcessLookupError:
        pass  # it ended meanwhile


def _launch(commands: list[list[str]], logs_dir) -> None:
    """Run the torchruns concurrently; on the first failure or at the deadline stop the others."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs, timed_out = [], [], False
    try:
        for i, cmd in enumerate(commands):
            logs.append(logs_dir / f"torchrun{i}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while True:
            rcs = [p.poll() for p in procs]  # poll every one: a failed node leaves the other waiting
            if None not in rcs or any(rc not in (None, 0) for rc in rcs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        _stop([p for p in procs if p.poll() is None])
    rcs = [p.returncode for p in procs]
    if rcs != [0] * len(procs):
        why = f"ran past {LAUNCH_TIMEOUT_S} s" if timed_out else "failed (the others were killed)"
        raise AssertionError(f"torchrun {why}, exit codes {rcs}:\n" +
                             "\n".join(f"--- {cmd}\n{_excerpt(log)}" for cmd, log in zip(commands, logs)))


def _read(path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict:
    """(a) One node of three ranks."""
    tmp = tmp_path_factory.mktemp("one_node")
    out = tmp / "out.json"
    _launch([[*TORCHRUN, "--standalone", "--nproc_per_node=3", SCRIPT, str(out)]], tmp)
    return _read(out)


def _check_ranks(ranks: list[dict]) -> None:
    assert [r["RANK"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert r["world_size"] == 3, r
        assert r["global_rank"] == r["RANK"], r
        assert r["local_rank"] == r["LOCAL_RANK"], "engine.local_rank must be torchrun's LOCAL_RANK"
    assert len({r["comm"] for r in ranks}) == 1, "every rank runs the same transport"


@pytest.mark.timeout(300)
def test_one_node_of_three(one_node):
    ranks = one_node["ranks"]
    _check_ranks(ranks)
    assert [(r["GROUP_RANK"], r["LOCAL_RANK"]) for r in ranks] == [(0, 0), (0, 1), (0, 2)]
    assert len(one_node["losses"]) == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_two_nodes_on_one_host_match_one_node(one_node, tmp_path, rdzv):
    """(b) Node 0 of one rank and node 1 of two, started together: the same losses as (a)."""
    out, port = tmp_path / "out.json", _free_port()
    if rdzv == "c10d":
        rendezvous = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={uuid.uuid4().hex}"]
    else:
        rendezvous = ["--master_addr=127.0.0.1", f"--master_port={port}"]
    _launch([[*TORCHRUN, "--nnodes=2", f"--node_rank={node}", f"--nproc_per_node={nproc}", *rendezvous,
              SCRIPT, str(out)]
             for node, nproc in [(0, 1), (1, 2)]], tmp_path)
    two_nodes = _read(out)

    ranks = two_nodes["ranks"]
    _check_ranks(ranks)
    nodes: dict[int, list[int]] = {}
    for r in ranks:  # global ranks run node by node
        nodes.setdefault(r["GROUP_RANK"], []).append(r["LOCAL_RANK"])
    if rdzv == "static":
        assert nodes == {0: [0], 1: [0, 1]}
    else:  # c10d numbers the nodes itself (see the module doc)
        assert sorted(nodes) == [0, 1] and sorted(nodes.values(), key=len) == [[0], [0, 1]]
    assert ranks[0]["comm"] == one_node["ranks"][0]["comm"], "torchrun nodes on one host are one host"
    assert two_nodes["losses"] == pytest.approx(one_node["losses"], rel=1e-6)
