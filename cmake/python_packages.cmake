# Where a Python package of the user's environment lives (the nvidia-cutlass and nvidia-nccl-cu13
# wheels): asked of the interpreter CMake found, then of `python3` on the PATH with the variables a
# `pip install .` build environment sets removed (pip's build isolation hides the user's
# site-packages from the build's own interpreter, where scripts/install-deps.sh put the wheels).
function(moekit_python_package_dir out code)
  set(${out} "" PARENT_SCOPE)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  set(_interpreters)
  if(Python3_Interpreter_FOUND)
    list(APPEND _interpreters "${Python3_EXECUTABLE}")
  endif()
  find_program(_moekit_outer_python NAMES python3 NO_CACHE)
  if(_moekit_outer_python)
    list(APPEND _interpreters "${_moekit_outer_python}")
  endif()
  foreach(py IN LISTS _interpreters)
    execute_process(
      COMMAND ${CMAKE_COMMAND} -E env --unset=PYTHONPATH --unset=PYTHONHOME --unset=PYTHONNOUSERSITE "${py}" -c "${code}"
      OUTPUT_VARIABLE _dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND _dir AND EXISTS "${_dir}")
      set(${out} "${_dir}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()
