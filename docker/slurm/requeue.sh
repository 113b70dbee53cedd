# shellcheck shell=bash
# Sourced by the ringfeed sbatch scripts: run the training launcher so that a job that reaches
# its time limit checkpoints, requeues itself and resumes (`ringfeed train ... --resume auto`).
#
# The scripts ask Slurm for SIGUSR1 to the batch shell 120 s before the limit
# (`#SBATCH --signal=B:USR1@120`; slurmctld looks at time limits every 30 s, so it comes 120 to
# 150 s before). On it the ranks get SIGTERM (`ringfeed train` then agrees across ranks to stop,
# saves a checkpoint and exits 143), the launcher gets up to RINGFEED_SAVE_GRACE_S (60) to
# finish, then `scontrol requeue`; the requeued job waits about 2 minutes (PENDING, Reason
# BeginTime), runs the script again and `--resume auto` continues from that checkpoint.
# A signal that comes before the ranks train (a limit shorter than start-up + 150 s) finds
# nothing to save: the job is requeued with nothing to resume from, each time.
#   ranks launched by srun (job steps):  SIGTERM to every step via scancel;
#   ranks launched by horovodrun:        SIGTERM to horovodrun, which passes it to its local
#                                        ranks (rank 0 runs on this node) and stops the others.
# Preemption needs nothing here: Slurm sends SIGTERM to the job's processes (the trainer saves)
# and requeues a job submitted with --requeue by itself.

ringfeed_requeue_requested=0
ringfeed_launcher_pid=""
ringfeed_ranks_are_steps=1

ringfeed_on_time_limit() {
  ringfeed_requeue_requested=1
  echo "ringfeed: time limit near: ranks checkpoint, then job ${SLURM_JOB_ID} is requeued"
  if [ "$ringfeed_ranks_are_steps" = 1 ]; then
    scancel --signal=TERM "${SLURM_JOB_ID}" || true
  elif [ -n "$ringfeed_launcher_pid" ]; then
    kill -TERM "$ringfeed_launcher_pid" 2>/dev/null || true
  fi
}

# ringfeed_run_requeueable steps|launcher LAUNCHER [ARG...]: runs the launcher (the first word
# says who gets the SIGTERM, see above); returns its exit status, and requeues the job
# if the time limit came near.
ringfeed_run_requeueable() {
  local launcher rc=0 waited=0
  case "$1" in
    steps) ringfeed_ranks_are_steps=1 ;;
    launcher) ringfeed_ranks_are_steps=0 ;;
    *) echo "ringfeed_run_requeueable: first argument must be steps or launcher" >&2; return 2 ;;
  esac
  shift
  echo "ringfeed: job ${SLURM_JOB_ID} on ${SLURM_JOB_NUM_NODES:-1} node(s), restart ${SLURM_RESTART_COUNT:-0}: $*"
  trap ringfeed_on_time_limit USR1
  "$@" &
  launcher=$!
  ringfeed_launcher_pid=$launcher
  while :; do
    if [ "$ringfeed_requeue_requested" = 0 ]; then
      # Returns when the launcher ends, or early (status 138) when the trapped SIGUSR1
      # arrives: then the next passes give the launcher its grace period and collect its own
      # status (bash keeps it for a second wait), even if it ended in the meantime.
      if wait "$launcher"; then rc=0; else rc=$?; fi
      [ "$ringfeed_requeue_requested" = 1 ] || break
    elif kill -0 "$launcher" 2>/dev/null && [ "$waited" -lt "${RINGFEED_SAVE_GRACE_S:-60}" ]; then
      sleep 1
      waited=$((waited + 1))
    else
      if ! kill -0 "$launcher" 2>/dev/null; then
        if wait "$launcher"; then rc=0; else rc=$?; fi
      fi
      break
    fi
  done
  trap - USR1
  if [ "$ringfeed_requeue_requested" = 1 ]; then
    echo "ringfeed: requeueing job ${SLURM_JOB_ID}; it resumes from the newest checkpoint"
    scontrol requeue "${SLURM_JOB_ID}"
  fi
  return "$rc"
}
