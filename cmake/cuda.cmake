# CUDA kernels (csrc/cuda/, csrc/include/orca/cuda/). Decides ORCA_EXT_HAS_CUDA from
# ORCA_EXT_CUDA:
#   AUTO  build them when torch has CUDA and a working nvcc is found; a CUDA torch without a
#         usable toolkit builds the CPU-only extension with a warning
#   ON    build them, or stop with a message saying what is missing
#   OFF   CPU-only
# nvcc is taken from CMAKE_CUDA_COMPILER, $CUDACXX, $CUDA_HOME/bin, PATH or /usr/local/cuda/bin.
# Architectures: $TORCH_CUDA_ARCH_LIST (torch's syntax, e.g. "8.0;9.0+PTX" or "9.0") when set,
# else CMAKE_CUDA_ARCHITECTURES when given, else sm_80 + sm_90 + compute_90 PTX.
# Headers/libraries the toolkit may lack (cuBLAS, cuSPARSE, cuSOLVER headers; libcublasLt) are
# also looked up in the pip `nvidia` packages next to torch (site-packages/nvidia/*/).
set(ORCA_EXT_HAS_CUDA OFF)

macro(_orca_cuda_unavailable)
  string(JOIN "" _why ${ARGV})
  if(ORCA_EXT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "orca_ext: ORCA_EXT_CUDA=ON, but ${_why}.")
  endif()
  message(WARNING "orca_ext: ${_why}. Building the CPU-only extension "
                  "(pass ORCA_EXT_CUDA=OFF to silence this warning, ON to make it an error).")
  set(_orca_cuda_ok OFF)
endmacro()

# torch-style arch list -> CMAKE_CUDA_ARCHITECTURES ("8.0" -> 80-real, "9.0+PTX" -> 90,
# "9.0a" -> 90a-real).
function(_orca_cuda_archs _list _out)
  string(REPLACE " " ";" _list "${_list}")
  string(REPLACE "," ";" _list "${_list}")
  set(_archs "")
  foreach(_a IN LISTS _list)
    if(_a STREQUAL "")
      continue()
    endif()
    if(NOT _a MATCHES "^([0-9]+)\\.([0-9]+)([af]?)(\\+PTX)?$")
      message(FATAL_ERROR "orca_ext: cannot parse '${_a}' in TORCH_CUDA_ARCH_LIST "
                          "(expected entries like 8.0, 9.0a or 9.0+PTX)")
    endif()
    set(_sm "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    if(CMAKE_MATCH_4)
      list(APPEND _archs "${_sm}")
    else()
      list(APPEND _archs "${_sm}-real")
    endif()
  endforeach()
  set(${_out} "${_archs}" PARENT_SCOPE)
endfunction()

if(ORCA_EXT_CUDA STREQUAL "OFF")
  message(STATUS "orca_ext: ORCA_EXT_CUDA=OFF, CPU-only extension")
elseif(NOT TORCH_CUDA_VERSION)
  if(ORCA_EXT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "orca_ext: ORCA_EXT_CUDA=ON, but torch ${TORCH_VERSION} was built "
                        "without CUDA. Install a CUDA build of torch or use ORCA_EXT_CUDA=AUTO/OFF.")
  endif()
  message(STATUS "orca_ext: torch ${TORCH_VERSION} has no CUDA, CPU-only extension")
else()
  set(_orca_cuda_ok ON)
  # ---- find nvcc -----------------------------------------------------------------------------
  set(_nvcc "")
  if(CMAKE_CUDA_COMPILER)
    set(_nvcc "${CMAKE_CUDA_COMPILER}")
  elseif(DEFINED ENV{CUDACXX} AND NOT "$ENV{CUDACXX}" STREQUAL "")
    set(_nvcc "$ENV{CUDACXX}")
  else()
    find_program(ORCA_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin"
                 PATHS /usr/local/cuda/bin)
    if(ORCA_NVCC)
      set(_nvcc "${ORCA_NVCC}")
    endif()
  endif()
  if(_nvcc STREQUAL "")
    _orca_cuda_unavailable("torch ${TORCH_VERSION} has CUDA ${TORCH_CUDA_VERSION} but no CUDA "
                           "toolkit (nvcc) was found: install the CUDA ${TORCH_CUDA_VERSION} "
                           "toolkit, put nvcc on PATH or set CUDA_HOME / CUDACXX")
  endif()
  # ---- check it runs and matches torch; resolve wrapper scripts to the real toolkit --------
  if(_orca_cuda_ok)
    execute_process(COMMAND "${_nvcc}" --version OUTPUT_VARIABLE _nvcc_out
                    RESULT_VARIABLE _nvcc_rc ERROR_QUIET)
    if(NOT _nvcc_rc EQUAL 0 OR NOT _nvcc_out MATCHES "release ([0-9]+)\\.([0-9]+)")
      _orca_cuda_unavailable("'${_nvcc} --version' failed: the CUDA toolkit looks broken")
    else()
      set(ORCA_NVCC_VERSION "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      set(_nvcc_major "${CMAKE_MATCH_1}")
      string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${TORCH_CUDA_VERSION}")
      if(NOT _nvcc_major STREQUAL _torch_cuda_major)
        _orca_cuda_unavailable("nvcc ${ORCA_NVCC_VERSION} (${_nvcc}) does not match the CUDA "
                               "${TORCH_CUDA_VERSION} that torch ${TORCH_VERSION} was built with "
                               "(the major versions must agree)")
      endif()
    endif()
  endif()
  if(_orca_cuda_ok)
    # nvcc may be a wrapper script (e.g. /usr/local/bin/nvcc); ask nvcc where its toolkit is.
    execute_process(COMMAND "${_nvcc}" -v -E -x cu /dev/null OUTPUT_QUIET
                    ERROR_VARIABLE _nvcc_v RESULT_VARIABLE _nvcc_rc)
    if(_nvcc_v MATCHES "#\\$ TOP=([^\n]*)")
      get_filename_component(_cuda_root "${CMAKE_MATCH_1}" REALPATH)
      if(EXISTS "${_cuda_root}/bin/nvcc")
        set(_nvcc "${_cuda_root}/bin/nvcc")
      endif()
    else()
      get_filename_component(_nvcc "${_nvcc}" REALPATH)
      get_filename_component(_cuda_root "${_nvcc}" DIRECTORY)
      get_filename_component(_cuda_root "${_cuda_root}" DIRECTORY)
    endif()
    set(CUDAToolkit_ROOT "${_cuda_root}")
    message(STATUS "orca_ext: nvcc ${ORCA_NVCC_VERSION} at ${_nvcc} (toolkit ${_cuda_root})")

    # pip packages of CUDA libraries next to torch (nvidia/cu13/, or nvidia/cublas/ etc.).
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import importlib.util as u, glob, os; s = u.find_spec('nvidia'); \
print(';'.join(sorted(d for p in (s.submodule_search_locations if s else []) \
for d in glob.glob(os.path.join(p, '*')) if os.path.isdir(os.path.join(d, 'include')))))"
      OUTPUT_VARIABLE _nv_pkgs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    set(ORCA_NVIDIA_PIP_INCLUDE_DIRS "")
    set(_nv_lib_dirs "")
    foreach(_d IN LISTS _nv_pkgs)
      list(APPEND ORCA_NVIDIA_PIP_INCLUDE_DIRS "${_d}/include")
      list(APPEND _nv_lib_dirs "${_d}/lib" "${_d}/lib64")
    endforeach()

    # ---- architectures ---------------------------------------------------------------------
    if(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
      _orca_cuda_archs("$ENV{TORCH_CUDA_ARCH_LIST}" _archs)
    elseif(CMAKE_CUDA_ARCHITECTURES)
      set(_archs "${CMAKE_CUDA_ARCHITECTURES}")
    else()
      _orca_cuda_archs("8.0;9.0+PTX" _archs)
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${_archs}")
    set(CMAKE_CUDA_COMPILER "${_nvcc}")
    set(CMAKE_CUDA_STANDARD 17)  # the .cu files are torch-free: C++17 is enough
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    message(STATUS "orca_ext: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")

    # cuBLASLt: the toolkit's, else the pip package torch itself loads.
    if(TARGET CUDA::cublasLt)
      set(_cublaslt CUDA::cublasLt)
    else()
      find_library(ORCA_CUBLASLT_LIBRARY NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
                   PATHS ${_nv_lib_dirs} NO_DEFAULT_PATH)
      set(_cublaslt "${ORCA_CUBLASLT_LIBRARY}")
    endif()
    find_path(ORCA_CUBLASLT_INCLUDE_DIR cublasLt.h
              PATHS ${CUDAToolkit_INCLUDE_DIRS} ${ORCA_NVIDIA_PIP_INCLUDE_DIRS} NO_DEFAULT_PATH)
    find_library(ORCA_TORCH_LIB_torch_cuda torch_cuda PATHS "${TORCH_DIR}/lib" NO_DEFAULT_PATH)
    find_library(ORCA_TORCH_LIB_c10_cuda c10_cuda PATHS "${TORCH_DIR}/lib" NO_DEFAULT_PATH)
    if(NOT _cublaslt OR NOT ORCA_CUBLASLT_INCLUDE_DIR)
      _orca_cuda_unavailable("cuBLASLt (cublasLt.h / libcublasLt) was found neither in the CUDA "
                             "toolkit at ${_cuda_root} nor in the pip nvidia packages")
    elseif(NOT ORCA_TORCH_LIB_torch_cuda OR NOT ORCA_TORCH_LIB_c10_cuda)
      _orca_cuda_unavailable("torch ${TORCH_VERSION} has no libtorch_cuda / libc10_cuda")
    endif()
  endif()

  if(_orca_cuda_ok)
    set(ORCA_EXT_HAS_CUDA ON)
    target_sources(_C PRIVATE
      csrc/cuda/apply_token_bitmask.cpp
      csrc/cuda/attention_bf16.cu
      csrc/cuda/attention_fp16.cu
      csrc/cuda/kernels.cu
      csrc/cuda/lora.cu
      csrc/cuda/lora_linear.cpp
      csrc/cuda/packed_linear.cpp
      csrc/cuda/ragged_attention.cpp
      csrc/cuda/rms_norm.cpp
      csrc/cuda/store_kv.cpp
      csrc/cuda/token_bitmask.cu)
    # Toolkit headers first; the pip packages fill in what the toolkit lacks (cuBLAS etc.).
    target_include_directories(_C SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS}
                               ${ORCA_NVIDIA_PIP_INCLUDE_DIRS})
    target_link_libraries(_C PRIVATE "${ORCA_TORCH_LIB_torch_cuda}" "${ORCA_TORCH_LIB_c10_cuda}"
                          CUDA::cudart ${_cublaslt})
    target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3>)
    # _C exists before CUDA is enabled, so its CUDA properties are set explicitly.
    set_target_properties(_C PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                          CUDA_RUNTIME_LIBRARY Shared CUDA_STANDARD 17
                          CUDA_STANDARD_REQUIRED ON)
    message(STATUS "orca_ext: building the CUDA kernels (cuBLASLt: ${_cublaslt})")
  endif()
endif()
target_compile_definitions(_C PRIVATE ORCA_EXT_HAS_CUDA=$<BOOL:${ORCA_EXT_HAS_CUDA}>)
