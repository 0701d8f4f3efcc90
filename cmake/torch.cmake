# Locates the installed PyTorch from the Python interpreter that runs the build and defines
# the imported target `orca_torch` (headers, libraries, ABI flag). We do not use
# find_package(Torch): its Caffe2 config insists on a CUDA toolkit whenever torch has CUDA,
# which would break CPU-only builds against a CUDA torch.
#
# The extension must be compiled against the torch it will be imported with, so torch is not a
# build requirement (pip's isolated build environment would fetch another one). Under pip's
# build isolation, which hides the environment's own packages behind PYTHONPATH, PYTHONPATH is
# dropped for the rest of the configure step: torch (and, in cuda.cmake, the pip CUDA
# libraries) then come from the environment being installed into.
set(_torch_query "import os, torch; print(os.path.dirname(torch.__file__)); \
print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or ''); \
print(torch.__version__)")
execute_process(COMMAND "${Python_EXECUTABLE}" -c "${_torch_query}"
                OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE _torch_rc ERROR_VARIABLE _torch_error)
if(NOT _torch_rc EQUAL 0 AND DEFINED ENV{PYTHONPATH})
  unset(ENV{PYTHONPATH})
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "${_torch_query}"
                  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _torch_rc ERROR_VARIABLE _torch_error)
endif()
if(NOT _torch_rc EQUAL 0)
  string(STRIP "${_torch_error}" _torch_error)
  string(REGEX MATCH "[^\n]*$" _torch_error "${_torch_error}")  # the exception's line
  message(FATAL_ERROR
    "orca_ext: cannot import torch in the Python environment being built for "
    "(${Python_EXECUTABLE}: ${_torch_error}). orca_ext compiles against the torch it will run "
    "with, so install torch first, then orca_ext:\n"
    "  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # CPU\n"
    "  pip install torch==2.14.1                                                    # CUDA 13.0\n"
    "  pip install .\n"
    "(A front end that builds in an environment of its own, such as uv, needs the build tools "
    "next to torch and no isolation: pip install scikit-build-core pybind11 ninja cmake, then "
    "pip install --no-build-isolation .)")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TORCH_DIR)
list(GET _torch_info 1 TORCH_CXX11_ABI)
list(GET _torch_info 2 TORCH_CUDA_VERSION)
list(GET _torch_info 3 TORCH_VERSION)
message(STATUS "orca_ext: torch ${TORCH_VERSION} at ${TORCH_DIR} (CUDA: '${TORCH_CUDA_VERSION}')")

add_library(orca_torch INTERFACE)
target_include_directories(orca_torch SYSTEM INTERFACE
  "${TORCH_DIR}/include" "${TORCH_DIR}/include/torch/csrc/api/include")
target_compile_definitions(orca_torch INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI} TORCH_EXTENSION_NAME=_C TORCH_API_INCLUDE_EXTENSION_H)
# NO_CACHE: a build folder reused with another torch (another environment) links that one's.
foreach(_lib c10 torch torch_cpu torch_python)
  find_library(ORCA_TORCH_LIB_${_lib} ${_lib} PATHS "${TORCH_DIR}/lib" NO_DEFAULT_PATH REQUIRED
               NO_CACHE)
endforeach()
target_link_libraries(orca_torch INTERFACE
  "${ORCA_TORCH_LIB_c10}" "${ORCA_TORCH_LIB_torch}" "${ORCA_TORCH_LIB_torch_cpu}")
# Only the Python module links torch's Python bindings (the C++ benchmarks have no Python).
add_library(orca_torch_python INTERFACE)
target_link_libraries(orca_torch_python INTERFACE "${ORCA_TORCH_LIB_torch_python}")
