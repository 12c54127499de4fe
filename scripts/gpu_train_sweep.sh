#!/usr/bin/env bash
# The training-graph sweep of the acceptance (scripts/performance/README.md, "The acceptance
# sweep"): the 2B geometry with random weights on mock data, everything trained, the variants of
# graph_variants.txt plus one with the default buckets (the recipe's 4096-token text maximum, so
# the text pads up to its power-of-two bucket and the vision rows up to theirs), for
#   448: one 448x448 image and 128 text tokens per micro-batch (launch-bound), and
#   896: one 896x896 image and text to 4096 tokens (compute-bound).
# Buckets for the workload: --seq-length set to the sample's own token count makes the largest
# text bucket the sample, and the vision maximum is the planned patch count, so the graphs pad
# nothing. Results go to $OUT (or out/). Carry .deps and tests/data/qwen3vl-tiny/tokenizer.json.
# ITERS (20) steps a run; WORKLOADS ("448 896"); VARIANTS: a variants file (graph_variants.txt);
# IRIS_BIN: the binary (a wrapper that bounds each run's time, say). A run of the 2B geometry
# spent 70 s of its start drawing the random weights before they were drawn on every thread: put
# fewer variants in one device call than its 10-minute limit holds at that pace.
source "$(dirname "$0")/gpu_env.sh"
if [ ! -x build-gpu/iris ]; then build_gpu iris || exit 1; fi
iters=${ITERS:-20}
workloads=${WORKLOADS:-448 896}
# PROBE (3): the last steps of each run, queued behind a held GPU for the host's own enqueue time.
# LOG_INTERVAL (1): steps between loss reads. Each read waits for the device, so at 1 the next
# step's input uploads cannot overlap the device's work; a full_iteration step uploads all its
# micro-batches before its one graph starts, and pays that time in full (about 20 ms at 896).
common=(--recipe qwen3vl_2b_pretrain_mock --device cuda --iters "$iters" --micro-batch-size 1
  --host-probe-steps "${PROBE:-3}" --log-interval "${LOG_INTERVAL:-1}"
  --global-batch-size 8 train.freeze_vision_tower=false train.freeze_language_model=false
  data.num_workers=4)
variants=(--variants "${VARIANTS:-scripts/performance/graph_variants.txt}")
for w in $workloads; do
  case $w in
    448) shape=(--seq-length 336 'data.mock_image_sizes=[[448,448]]' data.mock_text_tokens=128) ;;
    896) shape=(--seq-length 4096 'data.mock_image_sizes=[[896,896]]' data.mock_text_tokens=3300) ;;
    *) echo "unknown workload $w" >&2; exit 2 ;;
  esac
  extra=()
  # The default buckets: powers of two up to the recipe's 4096 tokens and the vision rows' own.
  [ "$w" = 448 ] && extra=(--variant "vision_decoder_default_buckets: --cuda-graph-impl local --vision-cuda-graph-impl local --seq-length 4096")
  echo "== sweep $w"
  scripts/performance/sweep.sh --out "$out/sweep_$w" --iris "${IRIS_BIN:-build-gpu/iris}" \
    "${variants[@]}" "${extra[@]}" -- \
    "${common[@]}" "${shape[@]}" 2>&1 | tee "$out/sweep_$w.txt"
done
