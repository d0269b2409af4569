"""Each step's name: the same on KFP and Argo, in events and on the console, and in the names of the
Kubernetes jobs a step creates. The pipeline (:mod:`relaunch.pipelines.spec`) wires the steps under these
names; a step reports under its own."""

PREPARE = "prepare"
LOCATE = "locate-latest-checkpoint"
LAUNCH = "launch"
EVALUATE = "evaluate"
REGISTER = "register"
FINALIZE = "finalize"
DELETE_JOB = "delete-training-job"
# the tuning pipeline (relaunch.pipelines.spec.TUNE_PIPELINE): prepare, then these, then evaluate and register
PLAN_TRIALS = "plan-trials"
RUN_TRIAL = "run-trial"
SELECT_TRIAL = "select-best-trial"
