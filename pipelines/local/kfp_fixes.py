"""What kfp.local 2.17 does not carry, and the three small fixes :func:`install_local_fixes` applies to it
(``relaunch run`` calls it before the pipeline starts):

1. ``dsl.If`` on a task output inside a nested DAG (our ExitHandler): its condition evaluator only
   resolves channels named ``<task>-Output`` or ``<task>--<key>``, so ``evaluate-passed`` resolves
   to nothing and the branch is silently skipped. The fix also resolves ``<task>-<key>``.
2. Retries ignore exit codes (as KFP v2 does everywhere): a permanent failure (bad input, exit 2)
   would be retried with backoff. The fix keeps the task's own retry policy and backoff but stops
   at once on a code that :func:`relaunch.components.core.contract.exitcodes.is_retryable` refuses.
3. Each task's command runs through the warm step server when ``relaunch run`` started one
   (:func:`use_warm_steps`), else as kfp.local's fresh subprocess; either way its exit code is kept
   for fix 2 (kfp.local itself only keeps success or failure). Unlike kfp.local's, the fresh subprocess
   is not waited for when the run is interrupted (its ``with Popen`` waited for the step to finish
   before ``relaunch run`` could stop it), and its output after that goes on to the run's log.

The retry loop reports ``attempt-end`` and ``retry`` events (:mod:`relaunch.components.core.contract.events`) to the
run's event file (``RELAUNCH_EVENTS``) that :mod:`relaunch.pipelines.local.console` tails.
tests/pipelines/test_kfp_local.py proves each fix is still needed and still works.

kfp.local has no public hook for any of the three, so this is the one module of relaunch that replaces
kfp's internals; tests/pipelines/test_warm_steps.py pins the kfp version and the replaced functions'
parameters, and fails by name when an upgrade changes them.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ...components.core.contract import events
from ...components.core.contract.events import Kind
from ...components.core.contract.exitcodes import ExitCode, is_retryable, normalize

_last_code = threading.local()
_warm_steps = None  # the running relaunch.pipelines.local.warm_steps.WarmSteps, when relaunch run started one
_run_log = None  # the run's pipeline.log: where a step's output goes once the run was interrupted


def use_warm_steps(warm_steps, run_log=None) -> None:
    """Run each task's command through ``warm_steps`` (None: every task a fresh subprocess again);
    ``run_log``: the run's log, for what a step prints after the run was interrupted."""
    global _warm_steps, _run_log
    _warm_steps, _run_log = warm_steps, run_log


def run_cold(full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
    """What kfp.local's ``run_local_subprocess`` does (the step as a fresh subprocess, its output echoed),
    except that an interruption is not held up until the step ends."""
    import os
    import subprocess

    from .warm_steps import relay_output

    process = subprocess.Popen(full_command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                               env={**os.environ, **env_vars} if env_vars else None)
    relay_output(process.stdout, _run_log)
    print("\n")
    return process.wait()


def install_local_fixes() -> None:
    """Patch kfp.local's condition resolver and retry loop (see the module docstring); idempotent."""
    from kfp.local import subprocess_task_handler as sth
    from kfp.local.orchestrator import enhanced_dag_orchestrator as edo
    from kfp.local.orchestrator import task_executor

    if getattr(task_executor, "_relaunch_fixed", False):
        return
    execute = task_executor.execute_single_task
    resolve = edo.ConditionEvaluator._resolve_pipeline_channel

    def recording_subprocess(full_command, env_vars=None):
        code = _warm_steps.run(full_command, env_vars) if _warm_steps is not None else None
        _last_code.value = run_cold(full_command, env_vars) if code is None else code
        return _last_code.value

    def resolve_channel(channel_ref: str, io_store):
        ref = channel_ref.removeprefix("pipelinechannel--")
        for i in (i for i, ch in enumerate(ref) if ch == "-"):
            with contextlib.suppress(ValueError):
                return io_store.get_task_output(ref[:i], ref[i + 1:])
        return resolve(channel_ref, io_store)

    def execute_by_exit_code(task_name, task_spec, **kwargs):
        policy = task_spec.retry_policy
        once = type(task_spec)()
        once.CopyFrom(task_spec)
        once.ClearField("retry_policy")
        for attempt in range(policy.max_retry_count + 1):
            _last_code.value = None
            outputs, status = execute(task_name=task_name, task_spec=once, **kwargs)
            code = ExitCode.OK if status.name == "SUCCESS" else normalize(_last_code.value or ExitCode.BUG)
            events.write(Kind.ATTEMPT_END, step=task_name, exit_code=int(code))
            if code == ExitCode.OK or attempt >= policy.max_retry_count or not is_retryable(code):
                return outputs, status
            delay = min(policy.backoff_duration.seconds * (policy.backoff_factor or 2.0) ** attempt,
                        policy.backoff_max_duration.seconds or 3600)
            events.write(Kind.RETRY, step=task_name, attempt=attempt + 1, limit=policy.max_retry_count, exit_code=int(code),
                         delay=delay)
            time.sleep(delay)
        return outputs, status

    sth.run_local_subprocess = recording_subprocess
    edo.ConditionEvaluator._resolve_pipeline_channel = staticmethod(resolve_channel)
    task_executor.execute_single_task = execute_by_exit_code
    task_executor._relaunch_fixed = True
