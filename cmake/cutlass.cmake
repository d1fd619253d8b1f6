# Finds the CUTLASS 4.2 headers: -DCUTLASS_DIR=<checkout> first, else the nvidia-cutlass wheel
# (python3 -m pip install --no-deps nvidia-cutlass==4.2.0.0, done by scripts/install-deps.sh).
set(_moekit_cutlass_candidates)
if(CUTLASS_DIR)
  list(APPEND _moekit_cutlass_candidates "${CUTLASS_DIR}")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/python_packages.cmake)
if(NOT CUTLASS_DIR)
  moekit_python_package_dir(_moekit_wheel_dir
    "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
  if(_moekit_wheel_dir)
    list(APPEND _moekit_cutlass_candidates "${_moekit_wheel_dir}")
  endif()
endif()

set(MOEKIT_CUTLASS_INCLUDE_DIRS "")
foreach(dir IN LISTS _moekit_cutlass_candidates)
  if(EXISTS "${dir}/include/cutlass/version.h")
    set(MOEKIT_CUTLASS_INCLUDE_DIRS "${dir}/include" "${dir}/tools/util/include")
    file(STRINGS "${dir}/include/cutlass/version.h" _v REGEX "#define CUTLASS_(MAJOR|MINOR) ")
    message(STATUS "moekit: CUTLASS headers at ${dir} (${_v})")
    break()
  endif()
endforeach()

if(NOT MOEKIT_CUTLASS_INCLUDE_DIRS)
  message(FATAL_ERROR
    "moekit: CUTLASS 4.2 headers not found (looked in: '${_moekit_cutlass_candidates}').\n"
    "Fix one of:\n"
    "  python3 -m pip install --no-deps nvidia-cutlass==4.2.0.0   (or run scripts/install-deps.sh)\n"
    "  cmake -DCUTLASS_DIR=/path/to/cutlass ...                    (a checkout holding include/cutlass)\n"
    "  cmake -DMOEKIT_CUDA=OFF ...                                 (CPU backend only)")
endif()
