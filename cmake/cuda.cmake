# CUDA kernels (issue: CUDA path). Decides ORCA_EXT_HAS_CUDA from ORCA_EXT_CUDA=AUTO|ON|OFF.
set(ORCA_EXT_HAS_CUDA OFF)
if(ORCA_EXT_CUDA STREQUAL "ON" OR (ORCA_EXT_CUDA STREQUAL "AUTO" AND TORCH_CUDA_VERSION))
  message(STATUS "orca_ext: CUDA kernels not built yet (CPU-only extension)")
endif()
target_compile_definitions(_C PRIVATE ORCA_EXT_HAS_CUDA=$<BOOL:${ORCA_EXT_HAS_CUDA}>)
