"""scripts/warm_python.py: a job forked from the warm interpreter runs as
``python3 <script>`` would in the job's folder: its argv, environment and
path, its exit status, multiprocessing children started from its folder, and
a job past its time limit killed with its session."""

import os
import time

import pytest

from .conftest import import_scripts

(warm_python,) = import_scripts("warm_python")

SCRIPT = """
import multiprocessing as mp, os, sys


def where(q):
    q.put(os.getcwd())


if __name__ == "__main__":
    print("argv", sys.argv, "path0", sys.path[0], "env", os.environ.get("JOB_VAR"))
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=where, args=(q,))
        p.start()
        p.join(120)
        print(method, p.exitcode, q.get(timeout=10))
    raise SystemExit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def warm():
    # multiprocessing imported in the server, from another directory than
    # the jobs' (its ORIGINAL_DIR is the server's)
    with warm_python.WarmPython(preload=("multiprocessing",)) as server:
        yield server


def test_job_runs_as_its_script_in_its_folder(warm, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "t.py").write_text(SCRIPT)
    log = tmp_path / "log"
    env = {**os.environ, "JOB_VAR": "set"}
    assert warm.run(["t.py", "3"], job, env, log, timeout=300) == 3
    text = log.read_text()
    assert f"argv ['t.py', '3'] path0 {job} env set" in text
    assert f"spawn 0 {job}" in text, text
    assert f"forkserver 0 {job}" in text, text


# The job's limit: the job must have started its child (an interpreter's
# start, seconds on a busy machine) before it is killed; 3 s was once not
# enough beside the live lane's servers (an empty log). Both sleep far longer.
JOB_LIMIT_S = 30
JOB_SLEEP_S = 600


def test_job_past_its_limit_is_killed_with_its_children(warm, tmp_path):
    (tmp_path / "s.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        f"'import time; time.sleep({JOB_SLEEP_S})'])\n"
        "print(child.pid, flush=True)\n"
        f"time.sleep({JOB_SLEEP_S})\n"
    )
    log = tmp_path / "log"
    start = time.monotonic()
    assert warm.run(["s.py"], tmp_path, dict(os.environ), log, JOB_LIMIT_S) is None
    assert time.monotonic() - start < JOB_SLEEP_S / 2  # cut off, not ended
    assert log.read_text().strip(), "the job was killed before it started its child"
    pid = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the job's child {pid} outlived the job")


def test_code_job_and_a_third_party_preload_that_imports_no_sglang(tmp_path):
    with warm_python.WarmPython(preload=("json",)) as server:
        log = tmp_path / "log"
        code = "import sys\nprint('sglang' in sys.modules, sys.argv[1:])"
        assert server.run(["-c", "x"], tmp_path, dict(os.environ), log, 30, code) == 0
        assert log.read_text().strip() == "False ['x']"


RENDEZVOUS = """
import os, sys, time
mine, theirs = sys.argv[1], sys.argv[2]
open(mine, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(theirs):
    if time.monotonic() > deadline:
        raise SystemExit(9)
    time.sleep(0.05)
raise SystemExit(int(sys.argv[3]))
"""


def test_jobs_of_two_threads_run_side_by_side(warm, tmp_path):
    # Each job waits for the other's file: one at a time, the first would
    # wait out its limit (None); side by side, both end with their own status.
    import concurrent.futures

    (tmp_path / "r.py").write_text(RENDEZVOUS)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def job(argv, name):
        log = tmp_path / f"{name}.log"
        return warm.run(["r.py", *argv], tmp_path, dict(os.environ), log, 90)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(job, [a, b, "3"], "a")
        second = pool.submit(job, [b, a, "4"], "b")
        assert (first.result(timeout=120), second.result(timeout=120)) == (3, 4)
