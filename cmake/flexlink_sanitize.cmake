# FLEXLINK_SANITIZE (docs/sanitizers.md): build everything C++ of this project -- the engine
# library, the nanobind module _flexlink and the C++ tests -- under a sanitizer.
#   address: AddressSanitizer + UndefinedBehaviorSanitizer; undefined behaviour aborts the program
#            (-fno-sanitize-recover) so a test cannot pass over it.
#   thread:  ThreadSanitizer.
# Host C++ only: nvcc-compiled kernels of the CUDA module are not instrumented. The module then
# needs the sanitizer's runtime loaded first (LD_PRELOAD) when Python imports it.
set(FLEXLINK_SANITIZE "" CACHE STRING "Build with a sanitizer: address (ASan + UBSan), thread (TSan), or empty")
set_property(CACHE FLEXLINK_SANITIZE PROPERTY STRINGS "" address thread)

# The optimisation of the project's libraries: -O3, or -O1 under a sanitizer, where -O3 costs 1.6x
# the ASan build's time for no faster tests (docs/sanitizers.md, "Build time").
set(FLEXLINK_OPT -O3)
if(FLEXLINK_SANITIZE STREQUAL "")
  return()
elseif(FLEXLINK_SANITIZE STREQUAL "address")
  set(_flexlink_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined)
elseif(FLEXLINK_SANITIZE STREQUAL "thread")
  set(_flexlink_sanitize_flags -fsanitize=thread)
else()
  message(FATAL_ERROR "FLEXLINK_SANITIZE=${FLEXLINK_SANITIZE}: expected address (ASan + UBSan), "
                      "thread (TSan) or empty (no sanitizer)")
endif()
# Frame pointers and line tables: readable stacks in the reports at little build cost.
set(FLEXLINK_OPT -O1)
list(APPEND _flexlink_sanitize_compile_flags ${_flexlink_sanitize_flags} -fno-omit-frame-pointer -g1)
add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_flexlink_sanitize_compile_flags}>")
add_link_options(${_flexlink_sanitize_flags})
message(STATUS "FlexLink: built with -fsanitize for ${FLEXLINK_SANITIZE} (docs/sanitizers.md)")
