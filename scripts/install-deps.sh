#!/usr/bin/env bash
# Installs what moekit needs on a fresh Debian 12 machine, idempotently: Debian packages (build
# tools, the CLI's and tests' libraries, Open MPI, OpenBLAS) and, where CUDA can be compiled, the
# CUTLASS 4.2 headers from PyPI. `--tests` adds what the test command needs: the CUTLASS headers in
# any case (the tests compile the CUDA code), clang and libFuzzer (the fuzz run), the Python
# package's build and test tools, torch and transformers (tests/parity; several GB). Safe to run
# again: each step checks first.
set -euo pipefail
with_tests=0
[[ ${1:-} == --tests ]] && with_tests=1

debian_packages=(
  cmake ninja-build ccache clang-format
  googletest libgtest-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev
  libopenmpi-dev openmpi-bin
  libopenblas-dev
  python3
)

# The test command fuzzes the untrusted input with libFuzzer, which comes with clang.
((with_tests)) && debian_packages+=(clang libclang-rt-dev)

missing=()
for pkg in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "install-deps: installing Debian packages: ${missing[*]}" >&2
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# CUTLASS headers (~30 MB), where the CUDA backend can be compiled (nvcc on the PATH or in the
# toolkit's default place) or the tests will compile it.
python=${PYTHON:-python3}
if { ((with_tests)) || command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; } &&
  ! "$python" -c 'import cutlass_library' 2>/dev/null; then
  echo "install-deps: installing nvidia-cutlass==4.2.0.0 (headers) from PyPI" >&2
  "$python" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
fi
((with_tests)) || { echo "install-deps: ok" >&2; exit 0; }
# The Python package's build and tests: nanobind (the module), NumPy and pytest (tests/python),
# scikit-build-core (pip install .).
if ! "$python" -c 'import nanobind, numpy, pytest, scikit_build_core' 2>/dev/null; then
  echo "install-deps: installing nanobind, numpy, pytest, scikit-build-core from PyPI" >&2
  "$python" -m pip install -q nanobind==2.9.2 numpy pytest scikit-build-core
fi
# tests/parity holds the layer to Hugging Face transformers' own MoE blocks: the versions it was
# checked against, pinned (torch as on the GPU machines).
torch_version=2.11.0
transformers_version=5.24.0
if ! "$python" -c "import torch, transformers, sys; sys.exit(not (torch.__version__.split('+')[0] == '$torch_version' and transformers.__version__ == '$transformers_version'))" 2>/dev/null; then
  echo "install-deps: installing torch==$torch_version transformers==$transformers_version from PyPI (tests/parity)" >&2
  "$python" -m pip install -q "torch==$torch_version" "transformers==$transformers_version"
fi
echo "install-deps: ok" >&2
