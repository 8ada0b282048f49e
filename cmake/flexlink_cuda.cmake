# The CUDA module jax_flexlink/_flexlink_cuda (FLEXLINK_CUDA=ON; docs/cuda.md): nvcc for the kernels,
# the host compiler for the rest, the CUDA runtime linked statically (it loads the driver at its first
# call, so the module imports without one) and NCCL's header only: NCCL itself is dlopen'ed at the
# first communicator (xla_ffi/cuda/runtime/nccl_comm.h).

# nvcc where CUDA installs it, unless the caller chose one (CMAKE_CUDA_COMPILER, CUDACXX, PATH).
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
# A100 (sm_80) and H100/H200 (sm_90, with PTX that newer GPUs compile at load). No GPU is needed to
# build, so nothing is detected from the build machine.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80-real;90")
endif()
enable_language(CUDA)
# C++20, as the host code. CMake 3.25 does not know nvcc 13's dialect flags (CUDA_STANDARD 20, which
# CUDA targets take from CXX_STANDARD, fails to generate), so tell it.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
find_package(CUDAToolkit REQUIRED)

# NCCL's header: FLEXLINK_NCCL_INCLUDE_DIR, else the nvidia-nccl-cu13 wheel of the Python that builds
# us (the NCCL jax's CUDA plugin loads), else the system's.
set(FLEXLINK_NCCL_INCLUDE_DIR "$ENV{FLEXLINK_NCCL_INCLUDE_DIR}" CACHE PATH "Directory of nccl.h")
if(NOT FLEXLINK_NCCL_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'include'))"
    OUTPUT_VARIABLE _flexlink_wheel_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _flexlink_rc)
  if(_flexlink_rc EQUAL 0 AND EXISTS "${_flexlink_wheel_nccl}/nccl.h")
    set(FLEXLINK_NCCL_INCLUDE_DIR "${_flexlink_wheel_nccl}" CACHE PATH "Directory of nccl.h" FORCE)
  endif()
endif()
if(NOT FLEXLINK_NCCL_INCLUDE_DIR)
  find_path(FLEXLINK_NCCL_SYSTEM_INCLUDE nccl.h PATHS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  if(FLEXLINK_NCCL_SYSTEM_INCLUDE)
    set(FLEXLINK_NCCL_INCLUDE_DIR "${FLEXLINK_NCCL_SYSTEM_INCLUDE}" CACHE PATH "Directory of nccl.h" FORCE)
  endif()
endif()
if(NOT FLEXLINK_NCCL_INCLUDE_DIR)
  message(FATAL_ERROR
    "FLEXLINK_CUDA=ON needs NCCL's header nccl.h: install nvidia-nccl-cu13 into the Python that builds "
    "(${Python_EXECUTABLE}; with pip, build with --no-build-isolation so that the build sees it) or pass "
    "-DFLEXLINK_NCCL_INCLUDE_DIR=<dir of nccl.h>")
endif()
message(STATUS "FlexLink CUDA: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}, "
               "nccl.h from ${FLEXLINK_NCCL_INCLUDE_DIR}")

file(GLOB FLEXLINK_CUDA_RUNTIME_SOURCES CONFIGURE_DEPENDS xla_ffi/cuda/runtime/*.cc xla_ffi/cuda/runtime/*.cu)
list(FILTER FLEXLINK_CUDA_RUNTIME_SOURCES EXCLUDE REGEX "/module\\.cc$")
# The call-frame decoding both platforms share (the same messages for a bad call).
list(APPEND FLEXLINK_CUDA_RUNTIME_SOURCES xla_ffi/ffi/decode.cc)
add_library(flexlink_cuda_runtime STATIC ${FLEXLINK_CUDA_RUNTIME_SOURCES})
target_include_directories(flexlink_cuda_runtime PRIVATE ${FLEXLINK_NCCL_INCLUDE_DIR})
target_link_libraries(flexlink_cuda_runtime PUBLIC flexlink_gpu_engine CUDA::cudart_static ${CMAKE_DL_LIBS})
# --fmad=false: no multiply-add contracted into an FMA in device code. The kernels' arithmetic
# (xla_ffi/cuda/elementwise.h) must be the host's bit for bit (nvcc's default --fmad=true made the
# complex product fused, off the CPU engine in the last bits); elementwise.h already writes every floating
# operation with the non-contractible _rn intrinsics, and this keeps any plain a*b+c added to device
# code later honest too. The kernels are memory-bound: FMA would gain nothing. (Bazel's nvcc rule,
# xla_ffi/BUILD.bazel, passes the same.)
target_compile_options(flexlink_cuda_runtime PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:-O3 -Wall -Wextra -fvisibility=hidden>
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --fmad=false -Xcompiler=-fvisibility=hidden>)

nanobind_add_module(_flexlink_cuda NB_STATIC xla_ffi/cuda/runtime/module.cc)
target_link_libraries(_flexlink_cuda PRIVATE flexlink_cuda_runtime)
target_compile_options(_flexlink_cuda PRIVATE -O3 -Wall)
install(TARGETS _flexlink_cuda LIBRARY DESTINATION jax_flexlink)

# GPU-only programs (benchmarks/gpu_check.sh runs them): at the top of the build directory.
# They load NCCL from FLEXLINK_NCCL_LIBRARY, else from the wheel next to the header found above.
if(FLEXLINK_BUILD_TESTS)
  get_filename_component(_flexlink_nccl_lib "${FLEXLINK_NCCL_INCLUDE_DIR}/../lib/libnccl.so.2" ABSOLUTE)
  foreach(name cuda_ranks_test cuda_pcie_bench)
    add_executable(${name} tests/cpp/cuda/${name}.cc)
    target_link_libraries(${name} PRIVATE flexlink_cuda_runtime)
    target_include_directories(${name} PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
    target_compile_definitions(${name} PRIVATE FLEXLINK_NCCL_LIBRARY_DEFAULT="${_flexlink_nccl_lib}")
    target_compile_options(${name} PRIVATE -O2 -UNDEBUG)
  endforeach()
endif()
