# Compile options for kvpolicy's OWN targets (tests, examples, benchmarks).
# Nothing here reaches consumers of kvpolicy::kvpolicy.
include_guard(GLOBAL)

# Host warnings, for C++ sources and for the host side of CUDA sources.
# KVPOLICY_WERROR turns them into errors.
function(kvpolicy_warnings target)
  set(cxx -Wall -Wextra -Wpedantic)
  set(cuda_host -Wall,-Wextra)
  if(KVPOLICY_WERROR)
    list(APPEND cxx -Werror)
    string(APPEND cuda_host ",-Werror")
  endif()
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:CXX>:${cxx}>"
    "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${cuda_host}>")
  if(KVPOLICY_WERROR)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>")
  endif()
endfunction()

# What every CUDA target of this project compiles with, beyond what kvpolicy::kvpolicy
# gives every consumer (-std=c++20 for nvcc: CMakeLists.txt). No --expt-relaxed-constexpr: the library compiles without it, and so must every
# target that shows users how to use it.
# KVPOLICY_PTXAS_VERBOSE (off) adds -Xptxas=-v: registers, shared memory and spills
# per kernel, printed at every build. Also applies kvpolicy_warnings(). Safe to call
# on a target without CUDA sources and when CUDA is off (the generator expressions
# then select nothing).
function(kvpolicy_cuda_options target)
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>")
  if(KVPOLICY_PTXAS_VERBOSE)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>")
  endif()
  kvpolicy_warnings(${target})
endfunction()

# AddressSanitizer + UndefinedBehaviorSanitizer (GCC or Clang), for a host target of
# this project (kvpolicy_tests_sanitized). -fno-sanitize-recover=all makes every UBSan
# finding fatal, so a finding fails the test instead of scrolling past. -g1 adds only
# line tables (cheap to compile), so a report's stack names files and lines.
# -O0 (after the build type's -O3, so it is the one that counts): on CI's 2 cores the
# build, not the run, is what costs. Measured with g++ 12 (-j1, tests/unit of 13
# files): -O0 builds in 90 s and runs in 24 s (CPU); -O1 builds in 181 s and runs in
# 12 s. Both report the same findings.
set(KVPOLICY_SANITIZE_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
function(kvpolicy_sanitize target)
  target_compile_options(${target} PRIVATE ${KVPOLICY_SANITIZE_FLAGS} -O0 -g1)
  target_link_options(${target} PRIVATE ${KVPOLICY_SANITIZE_FLAGS})
endfunction()
