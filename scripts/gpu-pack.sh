#!/usr/bin/env bash
# Packs what a build ON the GPU machine needs beside the source tree (which the device tool carries
# itself) into .gpusrc/ (git-ignored; carry it: `carry: [".gpusrc"]`), far under the 64 MiB limit:
#   deps.tar.xz  CUTLASS 4.2 headers (the nvidia-cutlass wheel) and a prefix of the header-only and
#                small libraries the GPU image lacks (fmt, nlohmann-json, CLI11, GoogleTest's static
#                libraries and headers), laid out as Debian installs them so their CMake configs work
#                from any directory;
#   wheels/          only with --build-tools: cmake and ninja from PyPI, for an image without them;
#   python-wheels/   only with --python-wheels: transformers (the version install-deps.sh pins) and
#                    pytest for the GPU machine's Python 3.12, for tests/parity there (gpu-check.sh python).
# scripts/gpu-build.sh unpacks it there, builds the asked-for targets with every core and runs the
# asked-for commands, in one device call.
set -euo pipefail
cd "$(dirname "$0")/.."
build_tools=0 python_wheels=0
for a in "$@"; do
  case $a in
    --build-tools) build_tools=1 ;;
    --python-wheels) python_wheels=1 ;;
    *) echo "gpu-pack: unknown option $a (--build-tools, --python-wheels)" >&2; exit 2 ;;
  esac
done
bash scripts/install-deps.sh --tests >/dev/null

out=.gpusrc
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
grep -qx '/.gpusrc/' .git/info/exclude 2>/dev/null || echo '/.gpusrc/' >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out"

# --- CUTLASS: include/ and tools/util/include, as cmake/cutlass.cmake expects under -DCUTLASS_DIR.
cutlass=$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')
mkdir -p "$stage/cutlass/tools/util"
cp -r "$cutlass/include" "$stage/cutlass/"
cp -r "$cutlass/tools/util/include" "$stage/cutlass/tools/util/"

# --- The prefix: Debian's files at Debian's relative paths (their CMake configs compute the prefix
# from their own location, so -DCMAKE_PREFIX_PATH=<prefix> finds them anywhere).
prefix_files() {
  dpkg -L libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev googletest 2>/dev/null |
    grep -E '^/usr/(include|lib/x86_64-linux-gnu|share/cmake)/' |
    grep -vE '^/usr/src/' | while read -r f; do [[ -f $f || -L $f ]] && echo "$f"; done
}
(cd / && prefix_files | sed 's|^/usr/||' | tar -C /usr --no-recursion -cf - -T -) | (mkdir -p "$stage/prefix" && tar -C "$stage/prefix" -xf -)

{ echo "packed $(date -u +%FT%TZ) from $(git rev-parse HEAD)"; dpkg-query -W libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev;
  python3 -m pip show nvidia-cutlass 2>/dev/null | grep -E '^(Name|Version)'; } > "$stage/PACKED.txt"
tar -C "$stage" -cf - cutlass prefix PACKED.txt | xz -T0 -6 > "$out/deps.tar.xz"

if ((build_tools)); then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out/wheels" cmake==3.31.6 ninja==1.11.1.4
fi
if ((python_wheels)); then
  python3 -m pip download -q "transformers==$(sed -n 's/^transformers_version=//p' scripts/install-deps.sh)" pytest \
    --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$out/python-wheels"
  rm -f "$out"/python-wheels/numpy-*.whl  # the GPU image's own NumPy, which its torch was built against
fi
du -sh "$out"/* | sed 's/^/gpu-pack: /' >&2
