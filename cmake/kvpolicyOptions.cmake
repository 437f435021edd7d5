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

# What every CUDA target of this project compiles with. CMake 3.25's CUDA_STANDARD 20
# adds no flag to nvcc 13, so the dialect is passed by hand, to CUDA sources only.
# Also applies kvpolicy_warnings(). Safe to call on a target without CUDA sources
# and when CUDA is off (the generator expressions then select nothing).
function(kvpolicy_cuda_options target)
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>"
    "$<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>"
    "$<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>")
  kvpolicy_warnings(${target})
endfunction()
