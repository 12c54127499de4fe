#!/usr/bin/env bash
# One training performance run: a recipe, performance overrides by name (CUDA graphs, batch,
# recompute, parallelism), `iris train` under the chosen launcher, and report.txt and
# report.json in the run folder. Megatron-Bridge's scripts/performance/run_script.py in bash: it
# needs nothing but bash and the iris binary (iris report reads the JSON).
#
#   scripts/performance/run.sh --recipe qwen3vl_2b_pretrain_mock --iters 20 \
#     --cuda-graph-impl local --vision-cuda-graph-impl local --out runs/perf/graphs
#
# Flags (scripts/performance/README.md has the details; --help prints them):
#   --recipe NAME|PATH             recipes/NAME.yaml, or a recipe file
#   --out DIR                      run folder (checkpoint.dir): metrics, run summary, report.*,
#                                  train.log (default runs/perf/<recipe name>)
#   --label NAME                   the run's name in its report (default: the --out folder's name)
#   --iris PATH                    the binary (default build-gpu/iris, build/iris, build-cpu/iris)
#   --launcher direct|mpirun|slurm direct runs iris; mpirun runs mpirun -np GPUS*NODES iris ...;
#                                  slurm prints an sbatch script (srun) and runs nothing
#   --gpus N, --nodes N            processes per node and nodes (default 1 and 1)
#   --launcher-args "ARGS"         extra words for mpirun or srun (--hostfile H, --map-by ...)
#   --sbatch-option OPT            an #SBATCH line of the slurm script (repeatable)
#   --iters N                      train.train_iters (default 20)
#   --log-interval N               logging.log_interval (default 1; each logged step waits for the
#                                  device, and the steady state starts after the first interval)
#   --host-probe-steps N           logging.host_probe_steps: the last N steps are queued while the
#                                  GPU is held, which gives the host's own enqueue time (the
#                                  report's "host, device held"; not part of the steady state)
#   --op-profile-step N            logging.op_profile_step: iteration N runs op by op and the log
#                                  gets its device time by op family, each against its floor (run
#                                  it with the graphs off; that step is not part of the steady
#                                  state)
#   --device cpu|cuda              train.device
#   --micro-batch-size N           train.micro_batch_size
#   --global-batch-size N          train.global_batch_size
#   --seq-length N                 train.seq_length
#   --recompute none|selective|full train.recompute
#   --offload-activations LIST     train.offload_activations: none, all or a comma list of the
#                                  decoder layers' activations (act,x_in; docs/training.md)
#   --data-parallel-size N         parallel.data_parallel_size (default GPUS*NODES/PP when > 1)
#   --pipeline-parallel-size N     parallel.pipeline_parallel_size
#   --sharding MODE                parallel.sharding: none|optimizer|optimizer_grads|
#                                  optimizer_grads_params (what the data-parallel ranks shard;
#                                  see docs/parallel-training.md)
#   --cuda-graph-impl none|local|full_iteration  cuda_graph.cuda_graph_impl
#   --cuda-graph-modules LIST      cuda_graph.cuda_graph_modules (comma list: attn,mlp)
#   --vision-cuda-graph-impl none|local          cuda_graph.vision_cuda_graph_impl
#   --vision-cuda-graph-modules LIST             cuda_graph.vision_cuda_graph_modules
#   --max-vision-graph-seq-len N   cuda_graph.max_vision_cuda_graph_seq_length
#   --vision-buckets LIST          cuda_graph.vision_cuda_graph_buckets (comma list of patch counts)
#   --graph-warmup-steps N         cuda_graph.cuda_graph_warmup_steps
#   --moe-expert-capacity-factor F model.moe_expert_capacity_factor (MoE: Megatron's drop; 0 dropless)
#   --moe-pad-expert-input-to-capacity true|false  model.moe_pad_expert_input_to_capacity
#   --moe-token-drop-policy probs|position          model.moe_token_drop_policy
#   --print-command                print the command instead of running it
#   --quiet                        the training log goes to DIR/train.log only
#   section.key=value              any recipe override, applied after the flags' (iris train
#                                  --list-keys lists them; iris refuses one it does not know)
#
# A performance run writes no checkpoints and runs no evaluation (checkpoint.save_interval=0,
# checkpoint.save_final=false, checkpoint.resume=never, train.eval_interval=0); key=value
# overrides change that. Exit status: iris train's, or 2 for a usage error.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
me=scripts/performance/run.sh

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

die() {
  echo "$me: $*" >&2
  exit 2
}

# Flags that set one recipe key each; list values become YAML lists.
declare -A key_of=(
  [--iters]=train.train_iters
  [--log-interval]=logging.log_interval
  [--host-probe-steps]=logging.host_probe_steps
  [--op-profile-step]=logging.op_profile_step
  [--device]=train.device
  [--micro-batch-size]=train.micro_batch_size
  [--global-batch-size]=train.global_batch_size
  [--seq-length]=train.seq_length
  [--recompute]=train.recompute
  [--offload-activations]=train.offload_activations
  [--pipeline-parallel-size]=parallel.pipeline_parallel_size
  [--data-parallel-size]=parallel.data_parallel_size
  [--sharding]=parallel.sharding
  [--cuda-graph-impl]=cuda_graph.cuda_graph_impl
  [--cuda-graph-modules]=cuda_graph.cuda_graph_modules
  [--vision-cuda-graph-impl]=cuda_graph.vision_cuda_graph_impl
  [--vision-cuda-graph-modules]=cuda_graph.vision_cuda_graph_modules
  [--max-vision-graph-seq-len]=cuda_graph.max_vision_cuda_graph_seq_length
  [--vision-buckets]=cuda_graph.vision_cuda_graph_buckets
  [--graph-warmup-steps]=cuda_graph.cuda_graph_warmup_steps
  [--moe-expert-capacity-factor]=model.moe_expert_capacity_factor
  [--moe-pad-expert-input-to-capacity]=model.moe_pad_expert_input_to_capacity
  [--moe-token-drop-policy]=model.moe_token_drop_policy
)
declare -A is_list=([--cuda-graph-modules]=1 [--vision-cuda-graph-modules]=1 [--vision-buckets]=1
  [--offload-activations]=1)
# The order overrides are written in, so that the command reads like the table above.
key_flags=(--iters --log-interval --host-probe-steps --op-profile-step --device --micro-batch-size --global-batch-size --seq-length
  --recompute --offload-activations --data-parallel-size --pipeline-parallel-size --sharding --cuda-graph-impl --cuda-graph-modules
  --vision-cuda-graph-impl --vision-cuda-graph-modules --max-vision-graph-seq-len --vision-buckets
  --graph-warmup-steps --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity
  --moe-token-drop-policy)

declare -A value=([--iters]=20 [--log-interval]=1)
recipe="" out="" label="" iris="" launcher=direct gpus=1 nodes=1 launcher_args=""
print_only=0 quiet=0
sbatch_options=()
raw=()
while [ $# -gt 0 ]; do
  arg=$1
  case $arg in
    --*=*)  # --flag=value is --flag value
      set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
      continue
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    --print-command) print_only=1; shift; continue ;;
    --quiet) quiet=1; shift; continue ;;
  esac
  if [[ $arg == -* ]]; then
    case $arg in
      --recipe | --out | --label | --iris | --launcher | --gpus | --nodes | --launcher-args | \
        --sbatch-option) ;;
      *) [ -n "${key_of[$arg]+x}" ] || die "unknown flag '$arg' (run $me --help for the flags; recipe keys go as section.key=value)" ;;
    esac
    [ $# -ge 2 ] || die "$arg needs a value"
    case $arg in
      --recipe) recipe=$2 ;;
      --out) out=$2 ;;
      --label) label=$2 ;;
      --iris) iris=$2 ;;
      --launcher) launcher=$2 ;;
      --gpus) gpus=$2 ;;
      --nodes) nodes=$2 ;;
      --launcher-args) launcher_args=$2 ;;
      --sbatch-option) sbatch_options+=("$2") ;;
      *) value[$arg]=$2 ;;
    esac
    shift 2
  elif [[ $arg =~ ^[A-Za-z_][A-Za-z0-9_]*\.[^=]+= ]]; then
    raw+=("$arg")
    shift
  else
    die "unexpected argument '$arg': flags start with --, recipe overrides look like section.key=value"
  fi
done

[ -n "$recipe" ] || die "--recipe is required (a name from recipes/ or a path); run $me --help"
if [ -f "$recipe" ]; then
  recipe_path=$recipe
elif [ -f "$root/recipes/$recipe.yaml" ]; then
  recipe_path=$root/recipes/$recipe.yaml
elif [ -f "$root/recipes/$recipe" ]; then
  recipe_path=$root/recipes/$recipe
else
  names=""
  for f in "$root"/recipes/*.yaml; do names+=" $(basename "$f" .yaml)"; done
  die "--recipe '$recipe' is neither a file nor a recipe in recipes/ (there:$names)"
fi
recipe_name=$(basename "$recipe_path" .yaml)

if [ -z "$iris" ]; then
  for candidate in build-gpu/iris build/iris build-cpu/iris; do
    if [ -x "$root/$candidate" ]; then
      iris=$root/$candidate
      break
    fi
  done
  [ -n "$iris" ] || die "no iris binary in build-gpu/, build/ or build-cpu/; build one (scripts/build.sh) or pass --iris PATH"
fi
[ -x "$iris" ] || die "--iris '$iris' is not an executable file"

for n in gpus nodes; do
  [[ ${!n} =~ ^[1-9][0-9]*$ ]] || die "--$n must be a positive integer, got '${!n}'"
done
world=$((gpus * nodes))
case $launcher in
  direct)
    [ "$world" -eq 1 ] || die "--launcher direct starts one process, but --gpus $gpus --nodes $nodes asks for $world; use --launcher mpirun or slurm"
    ;;
  mpirun | slurm) ;;
  *) die "--launcher must be direct, mpirun or slurm, got '$launcher'" ;;
esac
# One data-parallel rank per process (per pipeline's worth of them), as iris train requires.
if [ -z "${value[--data-parallel-size]+x}" ] && [ "$world" -gt 1 ]; then
  pp=${value[--pipeline-parallel-size]:-1}
  if ! [[ $pp =~ ^[1-9][0-9]*$ ]] || [ $((world % pp)) -ne 0 ]; then
    die "--pipeline-parallel-size '$pp' must divide the $world processes"
  fi
  value[--data-parallel-size]=$((world / pp))
fi

out=${out:-runs/perf/$recipe_name}
label=${label:-$(basename "$out")}
overrides=("checkpoint.dir=$out" checkpoint.save_interval=0 checkpoint.save_final=false
  checkpoint.resume=never train.eval_interval=0)
for flag in "${key_flags[@]}"; do
  [ -n "${value[$flag]+x}" ] || continue
  v=${value[$flag]}
  if [ -n "${is_list[$flag]+x}" ] && [[ $v != \[* ]]; then v="[$v]"; fi
  overrides+=("${key_of[$flag]}=$v")
done
overrides+=("${raw[@]}")

train=("$iris" train --recipe "$recipe_path" "${overrides[@]}")
report=("$iris" report "$out" --label "$label")
# Words as a shell reads them back: plain when safe, else in single quotes (more readable than
# printf %q's backslashes in the printed commands and scripts).
quote() {
  local out="" w q="'"
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then
      out+="$w "
    else
      out+="'${w//$q/$q\\$q$q}' "
    fi
  done
  printf '%s' "${out% }"
}
read -r -a extra <<<"$launcher_args"

if [ "$launcher" = slurm ]; then
  # Printed for the user to submit (sbatch); nothing runs here.
  echo "#!/bin/bash"
  echo "#SBATCH --job-name=$(quote "iris-$label")"
  if [ "${value[--device]:-}" = cpu ]; then
    echo "#SBATCH --nodes=$nodes --ntasks-per-node=$gpus"
  else
    echo "#SBATCH --nodes=$nodes --ntasks-per-node=$gpus --gpus-per-node=$gpus"
  fi
  for o in "${sbatch_options[@]}"; do echo "#SBATCH $o"; done
  echo "set -euo pipefail"
  echo "cd $(quote "$PWD")"
  echo "mkdir -p $(quote "$out")"
  echo "rm -f $(quote "$out/run_summary.json" "$out/report.json" "$out/report.txt")"
  echo "srun --mpi=pmix $(quote "${extra[@]}" "${train[@]}") 2>&1 | tee $(quote "$out/train.log")"
  echo "$(quote "${report[@]}") --command $(quote "srun --mpi=pmix $(quote "${extra[@]}" "${train[@]}")")"
  exit 0
fi

cmd=("${train[@]}")
[ "$launcher" = mpirun ] && cmd=(mpirun -np "$world" "${extra[@]}" "${train[@]}")
if [ "$print_only" = 1 ]; then
  quote "${cmd[@]}"
  echo
  exit 0
fi

mkdir -p "$out"
# A report left by an earlier run in this folder must not pass for this one's.
rm -f "$out/run_summary.json" "$out/report.json" "$out/report.txt"
echo "$me: $(quote "${cmd[@]}")" >&2
status=0
if [ "$quiet" = 1 ]; then
  "${cmd[@]}" >"$out/train.log" 2>&1 || status=$?
else
  "${cmd[@]}" 2>&1 | tee "$out/train.log" || status=${PIPESTATUS[0]}
fi
if [ "$status" -ne 0 ]; then
  echo "$me: iris train exited with $status; the log is $out/train.log" >&2
  [ "$quiet" = 1 ] && tail -n 15 "$out/train.log" >&2
  exit "$status"
fi
"${report[@]}" --command "$(quote "${cmd[@]}")"
