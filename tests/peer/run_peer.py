"""Run Megatron-LM's own dist_checkpointing tests (tag core_v0.16.1) on ours or on the real one.

::

    python tests/peer/run_peer.py                      # ours, 8 gloo ranks, every test file
    python tests/peer/run_peer.py --impl real          # the installed megatron-core (baseline)
    python tests/peer/run_peer.py --nproc 2 test_mapping.py test_strict.py -- -k "not msc"

One pytest per rank under torchrun, in the cache directory of ``fetch_megatron.py`` (which
fetches the tag's files first when needed), with ``megatron_plugin.py`` as the harness. A test
passes when it passes on every rank. The outcomes go to ``--out`` (``results.json``: test id →
outcome) and a per-file summary is printed; with ``--expect FILE`` (a JSON list of test ids)
the exit code is 1 when any of them did not pass.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import fetch_megatron  # noqa: E402

TEST_DIR = "tests/unit_tests/dist_checkpointing"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        tree[int(fields[1])].append(int(stat.parent.name))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun puts each rank in a session of
    its own, and ranks fork writers: a process group is not enough)."""
    tree, todo, found = _children(), [pid], []
    while todo:
        found.append(todo.pop())
        todo.extend(tree.get(found[-1], []))
    for victim in found:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def merge(rank_files: list[Path]) -> dict[str, str]:
    """One outcome per test over all ranks: passed only if every rank passed it."""
    per_test: dict[str, list[str]] = collections.defaultdict(list)
    for path in rank_files:
        for test, outcome in json.loads(path.read_text()).items():
            per_test[test].append(outcome)
    merged = {}
    for test, outcomes in per_test.items():
        missing = len(rank_files) - len(outcomes)
        if "failed" in outcomes or missing:
            merged[test] = "failed"
        elif all(o == "passed" for o in outcomes):
            merged[test] = "passed"
        else:
            merged[test] = "skipped" if "skipped" in outcomes else outcomes[0]
    return dict(sorted(merged.items()))


def summary(results: dict[str, str]) -> str:
    """``file: passed/total`` lines and the total."""
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for test, outcome in results.items():
        by_file[test.split("::")[0].rsplit("/", 1)[-1]][outcome] += 1
    lines = [f"{name}: {c['passed']}/{sum(c.values())} passed"
             + "".join(f", {n} {k}" for k, n in sorted(c.items()) if k != "passed")
             for name, c in sorted(by_file.items())]
    total = collections.Counter(results.values())
    lines.append(f"total: {total['passed']}/{sum(total.values())} passed "
                 + ", ".join(f"{n} {k}" for k, n in sorted(total.items()) if k != "passed"))
    return "\n".join(lines)


def run(impl: str, nproc: int, files: list[str], pytest_args: list[str], out: Path,
        timeout: float | None = None) -> dict[str, str]:
    """Run the suite once; return the merged outcomes (also written to ``out/results.json``)."""
    root = fetch_megatron.ensure()
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(CKPT_PEER_IMPL=impl, CKPT_PEER_OUT=str(out / "ranks"), CKPT_PEER_ROOT=str(root),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]))
    targets = [f if f.startswith("tests/") else f"{TEST_DIR}/{f}" for f in files] or [TEST_DIR]
    # each rank's pytest gets its own basetemp (torchrun does not expand $RANK itself)
    wrapper = out / "rank_pytest.sh"
    wrapper.write_text('#!/bin/sh\nexec "$PYTHON" -m pytest --basetemp="$BASE/rank$RANK" "$@"\n')
    wrapper.chmod(0o755)
    env.update(PYTHON=sys.executable, BASE=str(out / "tmp"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "--no-python", str(wrapper),
           "-p", "megatron_plugin", "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors", *targets, *pytest_args]
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.write(f"\nrun_peer: timed out after {timeout} s, every rank killed\n")
        finally:
            if proc.poll() is None:  # timed out or interrupted: leave no process behind
                kill_tree(proc.pid)
                proc.wait()
    rank_files = [out / "ranks" / f"rank{r}.json" for r in range(nproc)]
    present = [p for p in rank_files if p.exists()]
    results = merge(present) if present else {}
    if len(present) < nproc:  # a rank died: whatever it did not report is a failure
        results = {t: ("failed" if o == "passed" else o) for t, o in results.items()}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help=f"test files under {TEST_DIR} (default all)")
    parser.add_argument("--impl", choices=["ours", "real"], default="ours")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--expect", type=Path, help="JSON list of test ids that must pass")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before every rank is killed (unfinished tests fail)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix=f"ckpt-peer-{args.impl}-"))
    try:
        results = run(args.impl, args.nproc, args.files, extra, out, timeout=args.timeout)
    except fetch_megatron.FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(results))
    print(f"outcomes: {out / 'results.json'}, log: {out / 'log.txt'}")
    if args.expect:
        want = json.loads(args.expect.read_text())
        bad = [t for t in want if results.get(t) != "passed"]
        for t in bad:
            print(f"NOT PASSED: {t} ({results.get(t, 'not run')})")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
