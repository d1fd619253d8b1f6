# Finds NCCL with its device API (2.28+: nccl_device.h), whose code is inlined into moekit's kernels,
# so the library loaded at run time must be the same version (moekit checks at startup). Looks in:
# -DNCCL_ROOT=<dir holding include/nccl.h and lib/libnccl.so*>, the nvidia-nccl-cu13 wheel, the CUDA
# toolkit. Sets MOEKIT_NCCL (ON/OFF), MOEKIT_NCCL_INCLUDE_DIR, MOEKIT_NCCL_LIBRARY.
set(NCCL_ROOT "" CACHE PATH "NCCL with include/nccl.h and lib/libnccl.so (default: the nvidia-nccl-cu13 wheel, then the CUDA toolkit)")
set(_moekit_nccl_candidates)
if(NCCL_ROOT)
  list(APPEND _moekit_nccl_candidates "${NCCL_ROOT}")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/python_packages.cmake)
moekit_python_package_dir(_moekit_nccl_wheel
  "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])")
if(_moekit_nccl_wheel)
  list(APPEND _moekit_nccl_candidates "${_moekit_nccl_wheel}")
endif()
foreach(dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
  get_filename_component(_up "${dir}" DIRECTORY)
  list(APPEND _moekit_nccl_candidates "${_up}")
endforeach()

set(MOEKIT_NCCL OFF)
foreach(dir IN LISTS _moekit_nccl_candidates)
  if(EXISTS "${dir}/include/nccl.h" AND EXISTS "${dir}/include/nccl_device.h")
    find_library(_moekit_nccl_lib NAMES nccl libnccl.so.2 PATHS "${dir}/lib" "${dir}/lib64" NO_DEFAULT_PATH)
    if(_moekit_nccl_lib)
      file(STRINGS "${dir}/include/nccl.h" _v REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
      string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3" _ver "${_v}")
      if(_ver VERSION_GREATER_EQUAL 2.28)
        set(MOEKIT_NCCL ON)
        set(MOEKIT_NCCL_INCLUDE_DIR "${dir}/include")
        set(MOEKIT_NCCL_LIBRARY "${_moekit_nccl_lib}")
        message(STATUS "moekit: NCCL ${_ver} (device API) at ${dir}: run with this version's libnccl.so.2")
        break()
      endif()
    endif()
    unset(_moekit_nccl_lib CACHE)
  endif()
endforeach()
if(NOT MOEKIT_NCCL)
  message(WARNING
    "moekit: NCCL >= 2.28 with nccl_device.h not found (looked in: '${_moekit_nccl_candidates}'); the NCCL "
    "expert-parallel transports are not built. Fix: python3 -m pip install nvidia-nccl-cu13==2.28.9, or "
    "-DNCCL_ROOT=<dir with include/nccl.h and lib/libnccl.so>")
endif()
