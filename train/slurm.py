"""SLURM: `python -m train launcher=slurm nodes=N gpus=G partition=P ...` submits the run as one job of
N nodes x G tasks through submitit (the library DINO and DINOv2 are launched with) instead of training here.

Every task is one training process: it reads its rank from SLURM's variables (`dist_env`) and runs a
rank's life (`train.launch.start`) on the job's words, which always hold `run.resume=auto`, a fixed
`run.name` and `run.checkpoint_on_signal=USR2+TERM`; a task of a run that an earlier start finished
ends at once, with status 0. When SLURM warns of preemption or the coming time limit
(`--signal=USR2@120`), the ranks hold the signal until the next log step, save its checkpoint
(`train.dist.HeldSignal`), and only then let submitit's handler run: on rank 0 it calls
`Training.checkpoint` and requeues the job (`scontrol requeue`, the same job id); the requeued job's
tasks continue from that checkpoint, so no step is done twice. A job that reaches the time limit is
requeued up to `MAX_TIMEOUT_REQUEUES` times; a preempted one always. A preemption without the warning
(a site without `PreemptParameters=send_user_signal`: SIGTERM to every process, the kill after the
partition's GraceTime) is held the same way: the ranks save the step they reached and end (submitit
ignores SIGTERM), and SLURM requeues the job or cancels it as the partition says; the loader workers
leave both signals to their rank (`pipelines.processes`, rule 4).

The papers' protocols go the same way (`python -m train launcher=slurm gpus=G linear|finetune ckpt=...`,
`submit_protocol`): each task is one rank of the protocol, whose steps hold the same signal and save the
step they reached (`train.protocol`); the requeued job continues from the protocol's checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from train.config import Config, ConfigError
from train.launch import ClusterConfig, exit_status, preflight, start
from train.resolve import load_config
from train.run import folder_of, proposed_name

if TYPE_CHECKING:
    import submitit

MAX_TIMEOUT_REQUEUES = 30       # a 3-day time limit then covers 90 days of training (DINO's value)
SIGNAL = "USR2+TERM"            # SLURM's warning before preemption or the time limit (submitit's), its preemption
SIGNAL_DELAY_S = 120            # how long before the kill: time for a checkpoint and the requeue
PORTS = (20_000, 60_000)        # MASTER_PORT range; the port is the job id's, the same in every task
# A task that fails (its error one line in its log) ends the job's other tasks at once, instead of leaving
# them waiting in a collective for the process group's timeout (`run.dist_timeout_min`, 30 minutes of
# every GPU of the job) as srun does by default; a requeue ends them all anyway.
SRUN_ARGS = ("--kill-on-bad-exit=1",)


def requeueable(cfg: Config, words: list[str]) -> tuple[Config, list[str]]:
    """`cfg` and the CLI `words` as every start of the job runs them: `run.resume=auto`, and a `run.name`
    fixed now (`<method>-<data>-<time>` when none is given) so that a requeued job finds its run folder.

    Raises:
        ConfigError: `run.resume=<file>` (a job that is requeued continues its own run folder).
    """
    if cfg.run.resume not in ("", "auto"):
        raise ConfigError(f"launcher=slurm resumes with run.resume=auto from its run folder; to continue the run of "
                          f"{cfg.run.resume}, drop run.resume and give run.out_dir=<its run folder's parent> "
                          "run.name=<its run folder>")
    name = proposed_name(cfg)
    run = dataclasses.replace(cfg.run, resume="auto", name=name, checkpoint_on_signal=SIGNAL)
    return dataclasses.replace(cfg, run=run), [*words, "run.resume=auto", f"run.name={name}",
                                               f"run.checkpoint_on_signal={SIGNAL}"]


def dist_env(job: submitit.JobEnvironment) -> dict[str, str]:
    """The variables `torch.distributed`'s env:// init reads, for the SLURM task `job` describes.

    Args:
        job: submitit's view of SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NUM_NODES,
            SLURM_JOB_NODELIST and SLURM_JOB_ID.

    Returns:
        RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, and MASTER_ADDR (the job's first node, where rank
        0 runs) with MASTER_PORT (drawn from the job id: the same in every task, another in another job).
    """
    low, high = PORTS
    job_id = int(job.raw_job_id)
    return {"RANK": str(job.global_rank), "LOCAL_RANK": str(job.local_rank), "WORLD_SIZE": str(job.num_tasks),
            "LOCAL_WORLD_SIZE": str(job.num_tasks // job.num_nodes), "MASTER_ADDR": job.hostnames[0],
            "MASTER_PORT": str(low + job_id % (high - low))}


def clear_stale_result(job: submitit.JobEnvironment) -> None:
    """Remove this task's half-saved result of an earlier start of the same job (a requeued job keeps its
    id): submitit (1.5.4) saves a task's result through `<result>.save_tmp` and refuses to save it when
    that file exists, so a task killed while saving (the other tasks of a preempted job, when rank 0
    has requeued it and left) made the requeued task fail after its training had finished."""
    result = job.paths.result_pickle
    result.with_suffix(result.suffix + ".save_tmp").unlink(missing_ok=True)


class Training:
    """The job's callable: one SLURM task is one rank of `python -m train <words>`."""

    def __init__(self, words: list[str]) -> None:
        self.words = list(words)

    def __call__(self) -> None:
        import submitit

        job = submitit.JobEnvironment()
        clear_stale_result(job)
        os.environ.update(dist_env(job))
        status = exit_status(self._body)
        if status:
            raise RuntimeError(f"training ended with exit status {status}; its error is above in this task's log")

    def _body(self) -> int:
        from train import protocol

        if protocol.is_protocol(self.words):                 # a protocol's rank (`submit_protocol`)
            protocol.main(self.words[0], self.words[1:])
            return 0
        return start(self.words)

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """What submitit requeues on preemption or time-out (rank 0): the same training, which continues
        from the run folder's newest checkpoint (`run.resume=auto`)."""
        import submitit

        return submitit.helpers.DelayedSubmission(Training(self.words))


def submit_run(words: list[str], gpus: int, cluster: ClusterConfig) -> int:
    """`python -m train launcher=slurm ...`: the config of `words` for `cluster.nodes` x `gpus` processes,
    made requeueable (`requeueable`), checked (`launch.preflight`, not counting this machine's devices),
    and submitted (`submit`); not a run an earlier start finished (the line that says so).

    Raises:
        ConfigError, DatasetError, CheckpointError: see `preflight`, `requeueable` and `submit`.
    """
    cfg = load_config(words, world_size=gpus * cluster.nodes)
    cfg, words = requeueable(cfg, words)            # run.resume=auto in a run folder named now
    run = preflight(cfg, gpus, cluster.nodes, here=False)
    if run.finished:                                # nothing for a job to do
        print(run.finished_line(), flush=True)
        return 0
    return submit(words, gpus, cluster, cfg.run.name, folder_of(cfg), "run folder")


def submit_protocol(kind: str, args: list[str], gpus: int, cluster: ClusterConfig) -> int:
    """`python -m train launcher=slurm ... linear|finetune ckpt=... [key=value ...]`: the protocol checked
    for `cluster.nodes` x `gpus` processes (`protocol.preflight`) and submitted, its tasks holding SLURM's
    warning and SIGTERM (`run.checkpoint_on_signal=USR2+TERM`); not one an earlier start finished (the
    line that says so).

    Raises:
        ConfigError, DatasetError, CheckpointError: see `protocol.preflight` and `submit`.
    """
    from train import protocol

    words = [kind, *args, f"run.checkpoint_on_signal={SIGNAL}"]
    plan = protocol.preflight(kind, words[1:], gpus, cluster.nodes, here=False)
    if plan.done:
        print(f"{kind} evaluation ({plan.preset}) of {plan.ckpt} finished: {plan.results}; nothing to submit",
              flush=True)
        return 0
    folder = plan.runs["checkpoint"].folder
    return submit(words, gpus, cluster, f"{folder.name}-{plan.ckpt.parent.name}", folder, "protocol folder")


def submit(words: list[str], gpus: int, cluster: ClusterConfig, name: str, run_dir: Path, what: str) -> int:
    """Submit `Training(words)` as one SLURM job of `cluster.nodes` x `gpus` tasks, one GPU each; print
    the job id and where its logs go (`<run_dir>/slurm/<job id>_<task>_log.out`).

    Args:
        words: the CLI words every task runs, without the launcher words, already checked.
        gpus: GPUs (tasks) per node.
        cluster: nodes and the SLURM options.
        name: the job's name.
        run_dir: the folder the tasks write (a run's, a protocol's), where `slurm/` goes.
        what: what `run_dir` is, for the line printed.

    Returns:
        0 once SLURM accepted the job.

    Raises:
        ConfigError: submitit missing, no sbatch on this machine, or sbatch refusing the job.
    """
    try:
        import submitit
    except ImportError:
        raise ConfigError("launcher=slurm needs submitit: pip install 'viewmill[slurm]'") from None
    if not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError("launcher=slurm: no sbatch/srun here; submit from a SLURM login node, or start "
                          "torchrun on each node (docs/scale.md, Clusters)")
    folder = (run_dir / "slurm").absolute()
    created = next((d for d in (*reversed(folder.parents), folder) if not d.exists()), None)   # removed if refused
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=MAX_TIMEOUT_REQUEUES)
    optional = {"slurm_partition": cluster.partition, "slurm_account": cluster.account, "slurm_qos": cluster.qos,
                "slurm_constraint": cluster.constraint, "mem_gb": cluster.mem_gb}
    executor.update_parameters(
        name=name, nodes=cluster.nodes, tasks_per_node=gpus, gpus_per_node=gpus,
        cpus_per_task=cluster.cpus_per_task, timeout_min=cluster.time_min, slurm_signal_delay_s=SIGNAL_DELAY_S,
        slurm_additional_parameters={"requeue": True}, slurm_srun_args=list(SRUN_ARGS),
        **{k: v for k, v in optional.items() if v})
    try:
        with contextlib.redirect_stderr(io.StringIO()):     # submitit prints sbatch's error too
            job = executor.submit(Training(words))
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        detail = " ".join(str(e).split())
        raise ConfigError(f"sbatch refused the job: {detail}; check partition=, account=, qos=, time_min=") from None
    print(f"submitted SLURM job {job.job_id}: {cluster.nodes} node(s) x {gpus} GPU(s), {what} {run_dir} "
          f"(resumed from its newest checkpoint when requeued), logs {folder}/{job.job_id}_<task>_log.out")
    return 0
