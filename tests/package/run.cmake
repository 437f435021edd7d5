# Package tests, run by ctest as `cmake -D MODE=install|subdir ... -P run.cmake`.
#   install: `cmake --install` the kvpolicy build into WORK_DIR/prefix, then build
#            consumer/ against it with find_package(kvpolicy CONFIG) and run it (with
#            CUDA_COMPILER set, consumer/main_cuda.cu is built too, not run).
#   subdir:  build subdir/, which pulls the kvpolicy source tree in with
#            add_subdirectory and builds the same consumer/main.cpp, and run it.
cmake_minimum_required(VERSION 3.25)

foreach(var MODE WORK_DIR PACKAGE_DIR KVPOLICY_SOURCE_DIR KVPOLICY_BUILD_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run.cmake: -D ${var}=... is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc COMMAND_ECHO STDOUT)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test (${MODE}): command failed (${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(build ${WORK_DIR}/build)

set(configure_args -G ${GENERATOR} -D CMAKE_CXX_COMPILER=${CXX_COMPILER})
if(MAKE_PROGRAM)
  list(APPEND configure_args -D CMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(FMT_DIR)
  list(APPEND configure_args -D fmt_DIR=${FMT_DIR})  # the fmt the kvpolicy build used
endif()
set(config_args)
if(CONFIG)
  list(APPEND configure_args -D CMAKE_BUILD_TYPE=${CONFIG})
  set(config_args --config ${CONFIG})
endif()

if(MODE STREQUAL "install")
  set(prefix ${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --install ${KVPOLICY_BUILD_DIR} --prefix ${prefix} ${config_args})
  file(GLOB_RECURSE config_file ${prefix}/*/kvpolicyConfig.cmake)
  if(NOT EXISTS ${prefix}/include/kvpolicy/kvpolicy.hpp OR NOT config_file)
    message(FATAL_ERROR "install into ${prefix} lacks include/kvpolicy/kvpolicy.hpp or kvpolicyConfig.cmake")
  endif()
  # With nvcc, a CUDA consumer too, configured as README says and no more: sm_90a,
  # the library's default architecture.
  set(cuda_args)
  if(CUDA_COMPILER)
    set(cuda_args -D KVPOLICY_CONSUMER_CUDA=ON -D CMAKE_CUDA_COMPILER=${CUDA_COMPILER} -D CMAKE_CUDA_ARCHITECTURES=90a)
  endif()
  run(${CMAKE_COMMAND} -S ${PACKAGE_DIR}/consumer -B ${build} ${configure_args} ${cuda_args}
      -D CMAKE_PREFIX_PATH=${prefix}
      -D KVPOLICY_EXPECTED_PREFIX=${prefix}
      -D CMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
elseif(MODE STREQUAL "subdir")
  run(${CMAKE_COMMAND} -S ${PACKAGE_DIR}/subdir -B ${build} ${configure_args}
      -D KVPOLICY_SOURCE_DIR=${KVPOLICY_SOURCE_DIR})
else()
  message(FATAL_ERROR "run.cmake: MODE is '${MODE}'; expected install or subdir")
endif()

run(${CMAKE_COMMAND} --build ${build} ${config_args})
run(${build}/bin/kvpolicy_consumer)
