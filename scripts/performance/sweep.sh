#!/usr/bin/env bash
# Several performance runs in one go and one table of them: each variant is run.sh with the
# common arguments and its own, in its own folder, and the table (iris report --table) gives each
# one's steady-state step time, tokens/s and TFLOP/s per GPU, MFU, speed-up over the first
# variant (the reference, normally eager: its step time over the variant's), peak and graph
# memory, graphs, capture time and host enqueue and device time per step.
#
#   scripts/performance/sweep.sh --out runs/perf/sweep \
#     --variant "eager:" \
#     --variant "graphs: --cuda-graph-impl local --vision-cuda-graph-impl local" \
#     -- --recipe qwen3vl_2b_pretrain_mock --iters 20
#
# Flags before `--`:
#   --variant "NAME: ARGS"   a variant: NAME (letters, digits, . _ -) and run.sh arguments, split
#                            at spaces (no quoting); repeatable, in table order
#   --variants FILE          variants one per line in the same form (blank and # lines skipped)
#   --out DIR                sweep folder: DIR/NAME is each variant's run folder, DIR/sweep.json
#                            the table's rows (default runs/perf/sweep)
#   --iris PATH              the binary, for the runs and the table (default as run.sh)
#   --verbose                show each run's training log (default: DIR/NAME/train.log only)
# After `--`: run.sh arguments common to every variant (a variant's own come after them and win).
#
# A variant that fails is reported with the tail of its log and the sweep goes on; the table
# holds the variants that finished, and the exit status is 1 when any failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
me=scripts/performance/sweep.sh

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

die() {
  echo "$me: $*" >&2
  exit 2
}

names=()
declare -A args_of=()
add_variant() {
  local spec=$1 where=$2 name rest
  [[ $spec == *:* ]] || die "$where: variant '$spec' has no ':'; write \"NAME: run.sh arguments\""
  name=${spec%%:*}
  rest=${spec#*:}
  name=${name#"${name%%[![:space:]]*}"}
  name=${name%"${name##*[![:space:]]}"}
  [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] ||
    die "$where: variant name '$name' must be letters, digits, '.', '_' or '-' (it names a folder)"
  [ -z "${args_of[$name]+x}" ] || die "$where: variant '$name' is given twice"
  names+=("$name")
  args_of[$name]=$rest
}

out=runs/perf/sweep
iris=""
verbose=0
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; break ;;
    -h | --help) usage; exit 0 ;;
    --verbose) verbose=1; shift ;;
    --variant | --variants | --out | --iris)
      [ $# -ge 2 ] || die "$1 needs a value"
      case $1 in
        --variant) add_variant "$2" "--variant" ;;
        --variants)
          [ -f "$2" ] || die "--variants '$2' is not a file"
          line_no=0
          while IFS= read -r line || [ -n "$line" ]; do
            line_no=$((line_no + 1))
            [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
            add_variant "$line" "$2 line $line_no"
          done <"$2"
          ;;
        --out) out=$2 ;;
        --iris) iris=$2 ;;
      esac
      shift 2
      ;;
    *) die "unknown flag '$1' before '--' (sweep flags: --variant, --variants, --out, --iris, --verbose; run.sh arguments go after '--')" ;;
  esac
done
common=("$@")
[ ${#names[@]} -gt 0 ] || die "no variants: give --variant \"NAME: ARGS\" (the first is the reference) or --variants FILE"

# The sweep decides each run's folder and name, and runs them all here.
for ((i = 0; i < ${#common[@]}; i++)); do
  case ${common[$i]} in
    --out | --out=* | --label | --label=*) die "${common[$i]%%=*} is set per variant by the sweep (use the sweep's --out DIR)" ;;
    --print-command) die "--print-command does not go with a sweep; ask run.sh for one command" ;;
    --iris) [ -z "$iris" ] && iris=${common[$((i + 1))]:-} ;;
    --iris=*) [ -z "$iris" ] && iris=${common[$i]#--iris=} ;;
    --launcher) [ "${common[$((i + 1))]:-}" != slurm ] || die "--launcher slurm prints a script instead of running; a sweep runs its variants (use direct or mpirun)" ;;
    --launcher=slurm) die "--launcher slurm prints a script instead of running; a sweep runs its variants (use direct or mpirun)" ;;
  esac
done
if [ -z "$iris" ]; then
  for candidate in build-gpu/iris build/iris build-cpu/iris; do
    if [ -x "$root/$candidate" ]; then
      iris=$root/$candidate
      break
    fi
  done
  [ -n "$iris" ] || die "no iris binary in build-gpu/, build/ or build-cpu/; build one (scripts/build.sh) or pass --iris PATH"
fi

mkdir -p "$out"
reports=()
failed=()
for name in "${names[@]}"; do
  read -r -a vargs <<<"${args_of[$name]}"
  echo "== $name: run.sh ${common[*]} ${vargs[*]}"
  flags=(--iris "$iris" "${common[@]}" "${vargs[@]}" --out "$out/$name" --label "$name")
  [ "$verbose" = 1 ] || flags+=(--quiet)
  status=0
  if [ "$verbose" = 1 ]; then
    "$root/scripts/performance/run.sh" "${flags[@]}" || status=$?
  else
    "$root/scripts/performance/run.sh" "${flags[@]}" >"$out/$name.report.log" 2>&1 || status=$?
  fi
  if [ "$status" -ne 0 ]; then
    echo "   FAILED (exit $status); log: $out/$name/train.log"
    [ "$verbose" = 1 ] || sed 's/^/   | /' "$out/$name.report.log" | tail -n 20
    failed+=("$name")
    continue
  fi
  rm -f "$out/$name.report.log"
  grep -E '^(step time|tokens/s per GPU)' "$out/$name/report.txt" | sed 's/^/   /'
  reports+=("$out/$name/report.json")
done

echo
if [ ${#reports[@]} -gt 0 ]; then
  [ "${failed[0]:-}" != "${names[0]}" ] ||
    echo "note: the reference variant ${names[0]} failed, so the speed-ups are against the first variant that ran"
  "$iris" report --table "${reports[@]}" --json "$out/sweep.json"
  echo "rows: $out/sweep.json; reports: $out/NAME/report.txt"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
