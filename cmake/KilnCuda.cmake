# Decides whether the CUDA backend is built (KILN_CUDA=AUTO|ON|OFF) and, when it is,
# enables the CUDA language and finds the toolkit. Sets KILN_HAVE_CUDA and KILN_HAVE_NCCL
# (0/1) and KILN_CUDA_LIBS (what libkiln links for CUDA); KILN_HAVE_CUDNN (0/1),
# KILN_CUDNN_INCLUDE_DIR and KILN_CUDNN_LIBRARY for cuDNN (KILN_CUDNN=AUTO|ON|OFF).
#
# AUTO builds the backend whenever nvcc is found: the backend only *works* when a driver
# and a device are present at run time, and kiln_backend_available() says why not, so a
# build machine without a GPU still produces a library that uses one where there is one.

set(KILN_HAVE_CUDA 0)
set(KILN_HAVE_NCCL 0)
set(KILN_HAVE_CUDNN 0)
set(KILN_CUDA_LIBS "")
set(KILN_CUDNN "AUTO" CACHE STRING "cuDNN for CUDA convolutions: AUTO (when found next to the toolkit), ON (required), OFF (im2col + cuBLAS)")
set_property(CACHE KILN_CUDNN PROPERTY STRINGS AUTO ON OFF)

string(TOUPPER "${KILN_CUDA}" _kiln_cuda_mode)
if(NOT _kiln_cuda_mode MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "kiln: KILN_CUDA must be AUTO, ON or OFF (got '${KILN_CUDA}')")
endif()
if(_kiln_cuda_mode MATCHES "^(TRUE|YES|1)$")
  set(_kiln_cuda_mode ON)
elseif(_kiln_cuda_mode MATCHES "^(FALSE|NO|0)$")
  set(_kiln_cuda_mode OFF)
endif()

# "80,90" and "80;90" both work.
string(REPLACE "," ";" KILN_CUDA_ARCHS_LIST "${KILN_CUDA_ARCHS}")

if(NOT _kiln_cuda_mode STREQUAL "OFF")
  # Set before the language is enabled: CMake would otherwise probe a default that a
  # toolkit newer than this CMake may not accept.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "${KILN_CUDA_ARCHS_LIST}")
  endif()
  # nvcc's -O is the optimization of the *host* side of a .cu file (kernel launch stubs,
  # setup code); device code is optimized by cicc/ptxas regardless. At -O3 gcc spends
  # more time on the stubs of a kernel-heavy file than ptxas on the kernels; -O1 halves
  # the build of the CUDA backend and costs nothing measurable.
  set(CMAKE_CUDA_FLAGS_RELEASE "-O1 -DNDEBUG" CACHE STRING "CUDA flags for Release builds")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit)
  endif()
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    set(KILN_HAVE_CUDA 1)
    # KILN_CUDA_ARCHS wins when it changes between configures.
    set(CMAKE_CUDA_ARCHITECTURES "${KILN_CUDA_ARCHS_LIST}")
    set(KILN_CUDA_LIBS CUDA::cudart CUDA::cublas CUDA::cublasLt)
    message(STATUS "kiln: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${KILN_CUDA_ARCHS})")
  elseif(_kiln_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "kiln: KILN_CUDA=ON but no working CUDA compiler/toolkit was found "
                        "(put nvcc on PATH or set CMAKE_CUDA_COMPILER, or use KILN_CUDA=OFF)")
  else()
    message(STATUS "kiln: CUDA backend off (no nvcc found; KILN_CUDA=AUTO)")
  endif()
else()
  message(STATUS "kiln: CUDA backend off (KILN_CUDA=OFF)")
endif()

if(KILN_HAVE_CUDA)
  # libcudart.so for every target, never cudart_static: libkiln.so links CUDA::cudart
  # (shared), and two runtimes in one process would each hold their own device state.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  # NCCL ships with some toolkits (lib/ beside cudart) or on its own (/usr/local, distro).
  find_path(KILN_NCCL_INCLUDE_DIR nccl.h
            HINTS ${CUDAToolkit_INCLUDE_DIRS} "${CUDAToolkit_LIBRARY_ROOT}/include")
  find_library(KILN_NCCL_LIBRARY nccl
               HINTS "${CUDAToolkit_LIBRARY_DIR}" "${CUDAToolkit_LIBRARY_ROOT}/lib"
                     "${CUDAToolkit_LIBRARY_ROOT}/lib64")
  if(KILN_NCCL_INCLUDE_DIR AND KILN_NCCL_LIBRARY)
    set(KILN_HAVE_NCCL 1)
    list(APPEND KILN_CUDA_LIBS "${KILN_NCCL_LIBRARY}")
    message(STATUS "kiln: NCCL found: ${KILN_NCCL_LIBRARY}")
  else()
    message(STATUS "kiln: NCCL not found (multi-GPU collectives off)")
  endif()
endif()

# cuDNN (9.x, its legacy convolution API): the CONV2D kernels of src/backend/cuda/
# cuda_conv_cudnn.cu. Without it the convolution ops compose IM2COL + cuBLAS on CUDA.
string(TOUPPER "${KILN_CUDNN}" _kiln_cudnn_mode)
if(KILN_HAVE_CUDA AND NOT _kiln_cudnn_mode MATCHES "^(OFF|FALSE|NO|0)$")
  find_path(KILN_CUDNN_INCLUDE_DIR cudnn.h
            HINTS ${CUDAToolkit_INCLUDE_DIRS} "${CUDAToolkit_LIBRARY_ROOT}/include"
            PATH_SUFFIXES cudnn)
  find_library(KILN_CUDNN_LIBRARY cudnn
               HINTS "${CUDAToolkit_LIBRARY_DIR}" "${CUDAToolkit_LIBRARY_ROOT}/lib"
                     "${CUDAToolkit_LIBRARY_ROOT}/lib64")
  set(_kiln_cudnn_major 0)
  if(KILN_CUDNN_INCLUDE_DIR AND EXISTS "${KILN_CUDNN_INCLUDE_DIR}/cudnn_version.h")
    file(STRINGS "${KILN_CUDNN_INCLUDE_DIR}/cudnn_version.h" _kiln_cudnn_line REGEX "^#define CUDNN_MAJOR [0-9]+")
    string(REGEX REPLACE "^#define CUDNN_MAJOR ([0-9]+).*" "\\1" _kiln_cudnn_major "${_kiln_cudnn_line}")
  endif()
  if(KILN_CUDNN_INCLUDE_DIR AND KILN_CUDNN_LIBRARY AND _kiln_cudnn_major GREATER_EQUAL 8)
    set(KILN_HAVE_CUDNN 1)
    list(APPEND KILN_CUDA_LIBS "${KILN_CUDNN_LIBRARY}")
    message(STATUS "kiln: cuDNN ${_kiln_cudnn_major} found: ${KILN_CUDNN_LIBRARY}")
  elseif(_kiln_cudnn_mode MATCHES "^(ON|TRUE|YES|1)$")
    message(FATAL_ERROR "kiln: KILN_CUDNN=ON but no cuDNN >= 8 was found next to the CUDA toolkit "
                        "(cudnn.h: ${KILN_CUDNN_INCLUDE_DIR}, libcudnn: ${KILN_CUDNN_LIBRARY})")
  else()
    message(STATUS "kiln: cuDNN not found (convolutions on CUDA: im2col + cuBLAS)")
  endif()
elseif(KILN_HAVE_CUDA)
  message(STATUS "kiln: cuDNN off (KILN_CUDNN=OFF)")
endif()
