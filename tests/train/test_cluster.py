"""Many machines: 2 "nodes" x 1 process over torchrun's c10d rendezvous on 127.0.0.1 equal one node of 2
processes, a process killed on one ends both in one line each, and a rendezvous that never completes (a
node missing, a wrong address) is one line; the SLURM launcher writes the job it says (a stand-in
`sbatch` records it), its tasks map SLURM's variables to torch.distributed's, and the job, preempted and
requeued, ends where the 2-process run ends, as a linear protocol's job ends with the result of one never
stopped; `nodes=` without a rendezvous address and a SLURM launch that cannot work are one line each.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipelines.processes import proc_stat
from tests.processes import free_port, left_after, none_left_on_failure, start, tree, wait_for
from tests.train.test_train_cli import fails_in_one_line
from tests.train.two_ranks import ROOT, STEPS, WORDS, assert_same_training, env_here, losses
from train.__main__ import main
from train.config import to_dict


@pytest.mark.ddp
@pytest.mark.slow
def test_two_nodes_over_a_c10d_rendezvous_equal_one_node_of_two_processes(two_processes, tiny_args, tmp_path) -> None:
    """The same command on two "nodes" (two launchers, 1 process each, on 127.0.0.1) meets at the
    rendezvous and trains exactly as `gpus=2` does: ranks, shards and gathers map the same way, so
    losses and weights are bit-identical (gloo sums 2 ranks in the same order)."""
    out = tmp_path / "runs"
    command = [sys.executable, "-m", "train", "gpus=1", "nodes=2", f"rdzv=127.0.0.1:{free_port()}",
               *tiny_args("byol", out, *WORDS)]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=env_here(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sum("training byol on synthetic (torch backend, 2 rank(s), cpu)" in o for o in outputs) == 1, outputs
    assert_same_training(out / "run", two_processes)


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.parametrize("killed", ["holder", "other"])
def test_a_process_killed_on_one_node_ends_both_nodes_in_one_line_each(killed, tiny_args, tmp_path) -> None:
    """Two "nodes" (two launchers, 1 process each, on 127.0.0.1), the first holding the rendezvous's store;
    after step 2 one node's rank is killed with SIGKILL, and its launcher ends in one line naming the
    signal. "holder": on the other node the rank loses its peer and the launcher the rendezvous, each
    said in one line (they were torch's tracebacks); which the launcher tells depends on what reaches it
    first (the closed rendezvous, the store's end, or its rank's failure, then told by the rank). "other":
    the holder's rank is stopped first, as a rank waits in an NCCL collective (which, unlike gloo's,
    does not see its peer's end), and its launcher, which saw the rendezvous closed, stops it and says
    so in one line (it waited for good).
    Within seconds, and no process of either node is left."""
    port = free_port()
    command = ["-m", "train", "gpus=1", "nodes=2", f"rdzv=127.0.0.1:{port}",
               *tiny_args("byol", tmp_path / "runs", "optim.steps=400", "run.ckpt_every=1000")]
    holder = start(command)

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, 120, "the first node's rendezvous store", holder)
    other = start(command, mark=holder.mark)
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count('"train"') >= 2, 180, "step 2", other)
    [[holder_rank], [other_rank]] = [[pid for pid, _ in tree(n.pid) if proc_stat(pid)[2] == n.pid]
                                     for n in (holder, other)]
    if killed == "other":
        os.kill(holder_rank, signal.SIGSTOP)
    os.kill(holder_rank if killed == "holder" else other_rank, signal.SIGKILL)
    dead, alive = (holder, other) if killed == "holder" else (other, holder)
    errors = []
    with none_left_on_failure(holder.mark):         # a failed test leaves no stopped rank behind
        for node in (dead, alive):
            assert node.wait(timeout=60) == 1
            err = node.stderr.read()
            assert "Traceback" not in err, err
            errors.append([line for line in err.splitlines() if line.startswith("error: ")])
    assert errors[0] == [errors[0][0]] and errors[0][0].startswith("error: process 0 was killed by signal 9")
    closed = "error: another node closed the rendezvous"
    # the holder's end reaches the other launcher first as the store's, the closed rendezvous or its rank's
    said = (closed, "error: the rendezvous at 127.0.0.1:", "error: process 0 failed with exit status 1; its "
            "output is above") if killed == "holder" else (closed,)
    assert errors[1][-1].startswith(said)
    assert all("lost another process of the run" in e for e in errors[1][:-1])
    if errors[1][-1].startswith("error: process 0 failed"):       # the rank said why
        assert len(errors[1]) == 2
    else:
        assert "on every node continues" in errors[1][-1]
    assert left_after(holder.mark, 5) == []


@pytest.mark.ddp
@pytest.mark.slow
def test_ranks_that_see_different_checkpoints_stop_before_training_in_one_line(two_processes, tiny_args,
                                                                               tmp_path) -> None:
    """A run folder on each node's own disk, resumed: two ranks started as torchrun or SLURM starts them,
    one a node (here the second one's `run.out_dir` is another, empty folder). The first sees the
    checkpoint of step 12, the second none. They trained on from different steps before, with different
    target networks and optimiser states (DDP syncs only the online weights), and waited for each other
    for good at the end; now both stop before training, rank 0 with one line saying which ranks saw what
    and that the folder must be on shared storage, and nothing in the run folder changes."""
    import shutil

    shared, own = tmp_path / "shared", tmp_path / "own"
    shutil.copytree(two_processes, shared / "run")
    before = {f.name: f.read_bytes() for f in (shared / "run").iterdir() if f.is_file()}
    more = (f"optim.steps={STEPS + 2}", "run.ckpt_every=2", "data.num_workers=1", "run.resume=auto")
    env = dict(WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    first = start(["-m", "train", *tiny_args("byol", shared, *more)], RANK="0", **env)
    second = start(["-m", "train", *tiny_args("byol", own, *more)], mark=first.mark, RANK="1", **env)
    with none_left_on_failure(first.mark):          # they waited for each other for good before
        assert first.wait(timeout=120) == 2 and second.wait(timeout=60) == 2
    err, other = first.stderr.read(), second.stderr.read()
    assert "Traceback" not in err + other and other == "", err + other
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: the ranks see different checkpoints in {shared / 'run'} (step {STEPS} on 1 "
                           "rank(s) from rank 0; none on 1 rank(s) from rank 1)")
    assert "must be on storage that every node shares" in line
    assert {f.name: f.read_bytes() for f in (shared / "run").iterdir() if f.is_file()} == before
    assert left_after(first.mark, 5) == []


# `python -m train` with the launcher's waits shortened (torch's 600 s for the other nodes, 60 s a try of its store)
SHORT_WAITS = "import sys; import train.launch as l; l.JOIN_S, l.READ_S = 3, 1; from train.__main__ import main; " \
              "sys.exit(main(sys.argv[1:]))"


@pytest.mark.slow
def test_a_node_whose_rendezvous_never_completes_ends_in_one_line_that_says_why(tiny_args, tmp_path) -> None:
    """A user's first run on several machines, mistyped: "alone", the other node never comes (its
    launcher not started, or with other launcher words), and the waiting node ends in one line naming
    the rendezvous and what every node must run (it was torch's RendezvousTimeoutError traceback, after
    10 minutes); "elsewhere", `rdzv=` names a port where no rendezvous answers (another program holds
    it), and the node ends in one line saying so and what to check (it said, after 3 minutes, that
    the rendezvous "stopped answering" because the node holding it ended). No process starts: nothing
    is written. The line is all stderr holds: torch's store client had logged each try before it, with
    the C++ stack of its exception (103 lines in the 5 s of "elsewhere")."""
    from tests.train.two_ranks import ROOT, env_here

    other = socket.socket()                 # another program's port: it takes each connection and closes it
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    stop = threading.Event()

    def serve() -> None:
        other.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                other.accept()[0].close()

    threading.Thread(target=serve, daemon=True).start()
    rdzv = {"alone": f"127.0.0.1:{free_port()}", "elsewhere": f"127.0.0.1:{other.getsockname()[1]}"}
    runs = {case: subprocess.Popen([sys.executable, "-c", SHORT_WAITS, "gpus=1", "nodes=2", f"rdzv={at}",
                                    *tiny_args("byol", tmp_path / case)], cwd=ROOT, env=env_here(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for case, at in rdzv.items()}
    try:
        ended = {case: run.communicate(timeout=120) for case, run in runs.items()}
    finally:
        stop.set()
        for run in runs.values():
            run.kill()
        other.close()
    for case, (_, err) in ended.items():
        assert runs[case].returncode == 1 and "Traceback" not in err, err
        [line] = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert err.strip().splitlines() == [line], err      # torch's store client's C++ log and stacks left out
        assert not (tmp_path / case).exists()
    alone, elsewhere = ended["alone"][1].splitlines()[-1], ended["elsewhere"][1].splitlines()[-1]
    assert alone.startswith(f"error: the rendezvous at {rdzv['alone']} did not gather 2 nodes in 3 s")
    assert f"nodes=2 and rdzv={rdzv['alone']}) on every node" in alone
    assert elsewhere.startswith(f"error: no rendezvous answered at {rdzv['elsewhere']}")
    assert "used by nothing else" in elsewhere and "stopped answering" not in elsewhere


def test_nodes_without_a_rendezvous_or_an_unused_launcher_word_is_one_line(tiny_args, capsys, tmp_path,
                                                                           monkeypatch) -> None:
    out = tmp_path / "runs"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    fails_in_one_line(capsys, ["nodes=2", *tiny_args("byol", out)], "NODES=2 needs the rendezvous address",
                      "RDZV=<first node's host>:29500", "the same on every node")
    fails_in_one_line(capsys, ["nodes=0", *tiny_args("byol", out)], "nodes=0", "NODES=1")
    fails_in_one_line(capsys, ["nodes=two", *tiny_args("byol", out)], "'nodes'", "int")
    fails_in_one_line(capsys, ["launcher=k8s", *tiny_args("byol", out)], "'launcher'", "local, slurm")
    fails_in_one_line(capsys, ["partition=gpu", *tiny_args("byol", out)], "partition= is an option of the SLURM",
                      "LAUNCHER=slurm")
    fails_in_one_line(capsys, ["rdzv=node01:29500", *tiny_args("byol", out)], "NODES=<n> > 1", "or drop it")
    fails_in_one_line(capsys, ["gpus=2", "eval", f"ckpt={out}/run/checkpoint.pt"], "eval runs in this one process",
                      "drop gpus=")
    fails_in_one_line(capsys, ["launcher=slurm", "linear", f"ckpt={out}/run/checkpoint.pt"], "not found")
    assert not out.exists()


def fake_slurm(bin_dir: Path, job_id: int, sbatch_error: str = "") -> Path:
    """`sbatch`, `srun` and `scontrol` stand-ins on a new PATH folder: sbatch records its script and answers
    like SLURM (or fails with `sbatch_error`), scontrol records its arguments. Returns the record folder."""
    bin_dir.mkdir()
    sbatch = (f'echo "{sbatch_error}" >&2; exit 1' if sbatch_error else
              f'cp "$1" "{bin_dir}/sbatch.sh"; echo "Submitted batch job {job_id}"')
    for name, body in (("sbatch", sbatch), ("srun", "exit 1"), ("scontrol", f'echo "$@" >> "{bin_dir}/scontrol.log"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_slurm_launcher_writes_the_job_and_a_requeueable_callable(tiny_args, capsys, tmp_path, monkeypatch) -> None:
    """`launcher=slurm nodes=2 gpus=4 partition=...`: one sbatch script of 2 nodes x 4 tasks with a GPU
    each, the USR2 warning and --requeue, its srun ending every task when one fails; the pickled callable runs the training words with
    run.resume=auto in a run folder named at submission (none was given), without the launcher words,
    and requeues itself unchanged."""
    from submitit.core.utils import DelayedSubmission

    from train.slurm import Training

    fake = fake_slurm(tmp_path / "bin", 777)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "runs"
    words = tiny_args("byol", out, "run.name=")
    assert main(["launcher=slurm", "nodes=2", "gpus=4", "partition=gpu", "account=ssl", "time_min=600", *words]) == 0
    printed = capsys.readouterr().out
    assert "submitted SLURM job 777: 2 node(s) x 4 GPU(s)" in printed
    [run] = out.iterdir()
    assert run.name.startswith("byol-synthetic-") and [p.name for p in run.iterdir()] == ["slurm"]
    script = (fake / "sbatch.sh").read_text()
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=10", "--partition=gpu",
                 "--account=ssl", "--time=600", "--signal=USR2@120", "--requeue", "--job-name=" + run.name):
        assert f"#SBATCH {line}\n" in script, line
    srun = script.splitlines()[-1]
    assert srun.startswith("srun ") and f"-m submitit.core._submit {shlex.quote(str(run / 'slurm'))}" in srun
    assert " --kill-on-bad-exit=1 " in srun            # a failed task ends the others, not the NCCL timeout

    job = DelayedSubmission.load(run / "slurm" / "777_submitted.pkl")
    assert isinstance(job.function, Training)
    assert job.function.words == [*words, "run.resume=auto", f"run.name={run.name}",
                                  "run.checkpoint_on_signal=USR2+TERM"]
    again = job.function.checkpoint()
    assert isinstance(again.function, Training) and again.function.words == job.function.words


def test_slurm_variables_become_the_process_group_s(monkeypatch) -> None:
    """Task 5 of 8 (node 1 of 2, local rank 1) of job 4242 on gpu[07-08]: rank 5, GPU 1, world 8, rank 0's
    node as MASTER_ADDR and a port from the job id that every task computes alike."""
    import submitit

    from train.slurm import dist_env

    def task(rank: int) -> dict[str, str]:
        for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank),
                           "SLURM_LOCALID": str(rank % 4), "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
                           "SLURM_NODEID": str(rank // 4), "SLURM_JOB_NODELIST": "gpu[07-08]"}.items():
            monkeypatch.setenv(key, value)
        return dist_env(submitit.JobEnvironment())

    assert task(5) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "gpu07", "MASTER_PORT": "24242"}
    rank0 = task(0)
    assert (rank0["MASTER_ADDR"], rank0["MASTER_PORT"]) == ("gpu07", "24242")


def test_a_requeued_task_saves_its_result_where_a_killed_start_left_a_half_saved_one(tmp_path, monkeypatch) -> None:
    """Task 1 of a preempted job, killed while submitit saved its result, leaves `<result>.save_tmp`;
    the requeued job's task 1 (same job id) clears it before training, so that submitit can save the
    result at the end (it refuses to while that file exists)."""
    import submitit
    from submitit.core.utils import temporary_save_path

    from train.slurm import Training

    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": str(tmp_path), "SLURM_JOB_ID": "4242",
                       "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2",
                       "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}.items():
        monkeypatch.setenv(key, value)
    job = submitit.JobEnvironment()
    result = job.paths.result_pickle
    with pytest.raises(KeyboardInterrupt), temporary_save_path(result) as half:
        half.write_bytes(b"half")
        raise KeyboardInterrupt                           # killed while saving: the move never happens
    with pytest.raises(AssertionError, match="temporary saved file already exists"), temporary_save_path(result):
        pass                                              # what the requeued task met at its end
    monkeypatch.setattr(os, "environ", dict(os.environ))                # the task's variables stay in it
    with pytest.raises(RuntimeError, match="exit status 2"):
        Training(["method=nosuch"])()                                    # a task's start: cleared first
    assert not half.exists()
    with temporary_save_path(result) as tmp:
        tmp.write_bytes(b"done")
    assert result.read_bytes() == b"done"


def test_a_slurm_launch_that_cannot_work_is_one_line_and_writes_nothing(tiny_args, capsys, tmp_path,
                                                                        monkeypatch) -> None:
    out = tmp_path / "runs"
    words = ["launcher=slurm", "nodes=2", *tiny_args("byol", out)]
    monkeypatch.setenv("PATH", str(tmp_path))
    fails_in_one_line(capsys, words, "no sbatch/srun here", "torchrun on each node")
    fails_in_one_line(capsys, [*words, f"run.resume={tmp_path / 'x.pt'}"], "run.resume=auto", "drop run.resume")
    refusing = fake_slurm(tmp_path / "bin", 1, sbatch_error="sbatch: error: invalid partition specified: nope")
    monkeypatch.setenv("PATH", f"{refusing}{os.pathsep}{os.environ['PATH']}")
    fails_in_one_line(capsys, [*words, "partition=nope"], "sbatch refused the job",
                      "invalid partition specified: nope", "check partition=")
    monkeypatch.setitem(sys.modules, "submitit", None)             # not installed
    fails_in_one_line(capsys, words, "pip install 'viewmill[slurm]'")
    assert not out.exists()


def start_task(folder: Path, job_id: int, rank: int, log: Path, nodes: int = 2) -> subprocess.Popen:
    """Task `rank` of a `nodes`-node x 1-task job, started as the job's srun line starts it (in a session
    of its own, so that a signal to its process group reaches it and its loader workers alone)."""
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": str(job_id), "SLURM_PROCID": str(rank),
             "SLURM_LOCALID": "0", "SLURM_NTASKS": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
             "SLURM_NODEID": str(rank), "SLURM_JOB_NODELIST": "localhost"}
    with log.open("a") as f:
        return subprocess.Popen([sys.executable, "-u", "-m", "submitit.core._submit", str(folder)], cwd=ROOT,
                                env=env_here(**slurm), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.ddp
@pytest.mark.slow
def test_a_preempted_slurm_job_checkpoints_where_it_is_is_requeued_and_ends_as_the_uninterrupted_run(
        two_processes, tiny_args, tmp_path, monkeypatch) -> None:
    """The submitted job's two tasks (two "nodes", started here as srun would) train with a checkpoint
    only at the end. SLURM's preemption reaches rank 1's processes (its loader worker too: SLURM signals
    every process of the step) and not rank 0's, with the USR2 warning and SIGTERM at once (a site's
    `PreemptParameters=send_user_signal`; submitit's task ignores SIGTERM, and the worker leaves it to
    the task): at the next log step both ranks save that step, rank 0 requeues the job (scontrol
    requeue <id>) and exits; the requeued job's tasks continue from that checkpoint, redo no step, and
    end bit-identical to the 2-process run."""
    job_id = free_port(20_000, 60_000) - 20_000     # its MASTER_PORT (20000 + id) is free now
    fake = fake_slurm(tmp_path / "bin", job_id)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "runs"
    assert main(["launcher=slurm", "nodes=2", "gpus=1", *tiny_args("byol", out, *WORDS, "run.ckpt_every=100")]) == 0
    run, log = out / "run", tmp_path / "tasks.log"

    tasks = [start_task(run / "slurm", job_id, rank, log) for rank in range(2)]
    deadline = time.monotonic() + 240
    while len(losses(run) if (run / "metrics.jsonl").exists() else {}) < 2 and time.monotonic() < deadline:
        assert tasks[0].poll() is None, log.read_text()
        time.sleep(0.02)
    os.killpg(tasks[0].pid, signal.SIGSTOP)         # rank 0 stops between steps 2 and STEPS, rank 1 with it
    os.killpg(tasks[1].pid, signal.SIGUSR2)         # SLURM's warning, to rank 1 and its worker alone,
    os.killpg(tasks[1].pid, signal.SIGTERM)         # and its preemption's SIGTERM
    os.killpg(tasks[0].pid, signal.SIGCONT)
    assert tasks[0].wait(timeout=120) != 0, log.read_text()
    tasks[1].wait(timeout=60)                       # saved, and ended (a real job's requeue would end it)
    assert (fake / "scontrol.log").read_text() == f"requeue {job_id}\n", log.read_text()
    first = losses(run)
    saved = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
    assert 2 <= saved == max(first) < STEPS, (saved, first)     # the step it reached, none after it

    tasks = [start_task(run / "slurm", job_id, rank, log) for rank in range(2)]   # the requeued job
    assert [t.wait(timeout=300) for t in tasks] == [0, 0], log.read_text()
    assert f"resuming from {run / 'checkpoint.pt'}" in log.read_text()
    assert_same_training(run, two_processes)


@pytest.mark.slow
def test_a_protocol_submitted_to_slurm_saves_where_it_is_warned_and_the_requeued_job_ends_it(tiny_args, tmp_path,
                                                                                            monkeypatch) -> None:
    """`launcher=slurm gpus=1 linear ckpt=...`: one job whose task runs the linear protocol with SLURM's
    warning held. The warning mid-protocol saves the step the protocol reached, and the task requeues
    the job (scontrol requeue <id>); the requeued task continues at that step and writes the result of
    the protocol run without a stop."""
    from submitit.core.utils import DelayedSubmission

    from train import checkpoint
    from train.resolve import load_config
    from train.setup import build_online
    from train.slurm import Training

    cfg = load_config(tiny_args("byol", tmp_path / "runs"))
    online = build_online(cfg, torch.device("cpu"))
    ckpt = checkpoint.save(tmp_path / "runs" / "run" / "checkpoint.pt",
                           {"config": to_dict(cfg), "online": online.state_dict(), "step": 3})
    reference = checkpoint.save(tmp_path / "reference" / "checkpoint.pt", checkpoint.load(ckpt))
    words = ["preset=small", "epochs=40", "batch_size=16", "ckpt_every=1000", "log_every=1", "run.device=cpu"]
    whole = subprocess.run([sys.executable, "-m", "train", "linear", f"ckpt={reference}", *words], cwd=ROOT,
                           env=env_here(), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = json.loads((reference.parent / "linear_eval.json").read_text())

    job_id = free_port(20_000, 60_000) - 20_000
    fake = fake_slurm(tmp_path / "bin", job_id)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert main(["launcher=slurm", "gpus=1", "linear", f"ckpt={ckpt}", *words]) == 0
    folder = ckpt.parent / "linear-small"
    assert "--job-name=linear-small-run" in (fake / "sbatch.sh").read_text()
    job = DelayedSubmission.load(folder / "slurm" / f"{job_id}_submitted.pkl")
    assert isinstance(job.function, Training)
    assert job.function.words == ["linear", f"ckpt={ckpt}", *words, "run.checkpoint_on_signal=USR2+TERM"]

    log = tmp_path / "task.log"
    task = start_task(folder / "slurm", job_id, 0, log, nodes=1)
    deadline = time.monotonic() + 240
    while len(protocol_steps(folder)) < 2 and time.monotonic() < deadline:      # of 160 steps
        assert task.poll() is None, log.read_text()
        time.sleep(0.02)
    os.killpg(task.pid, signal.SIGSTOP)
    os.killpg(task.pid, signal.SIGUSR2)             # SLURM's warning, to the task and its loader worker
    os.killpg(task.pid, signal.SIGCONT)
    assert task.wait(timeout=120) != 0, log.read_text()
    assert (fake / "scontrol.log").read_text() == f"requeue {job_id}\n", log.read_text()
    saved = checkpoint.load(folder / "checkpoint.pt")["step"]
    assert 2 <= saved == max(protocol_steps(folder)) < 160 and not (ckpt.parent / "linear_eval.json").exists()

    task = start_task(folder / "slurm", job_id, 0, log, nodes=1)       # the requeued job
    assert task.wait(timeout=300) == 0, log.read_text()
    assert f"resuming {folder} from step {saved}" in log.read_text()
    got = json.loads((ckpt.parent / "linear_eval.json").read_text())
    assert (got["top1"], got["top5"]) == (expected["top1"], expected["top5"])


def protocol_steps(folder: Path) -> list[int]:
    """The steps a protocol's metrics.jsonl logged so far."""
    if not (folder / "metrics.jsonl").is_file():
        return []
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines[:-1] if lines and not lines[-1].endswith("}") else lines)
            if r.get("kind") == "train"]
