# Installs kvcache from KVCACHE_BINARY_DIR into WORK_DIR/prefix, then compiles and runs
# main.cpp with nothing but the flags `pkg-config --cflags --libs kvcache` gives, as a
# host built without CMake would. Fails on any step; prints "pkg-config not found" (the
# test then reports a skip) where the tool is missing.
find_program(PKG_CONFIG_EXE pkg-config)
if(NOT PKG_CONFIG_EXE)
  message("pkg-config not found")
  return()
endif()
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${KVCACHE_BINARY_DIR} --prefix ${WORK_DIR}/prefix
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
file(GLOB_RECURSE pc_files ${WORK_DIR}/prefix/*/kvcache.pc)
list(LENGTH pc_files n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "expected one installed kvcache.pc, found: ${pc_files}")
endif()
get_filename_component(pc_dir ${pc_files} DIRECTORY)
execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pc_dir}
                        ${PKG_CONFIG_EXE} --cflags --libs kvcache
                OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "pkg-config --cflags --libs kvcache failed: ${rc}")
endif()
message("pkg-config --cflags --libs kvcache: ${flags}")
separate_arguments(flag_list UNIX_COMMAND "${flags}")
execute_process(COMMAND ${CXX_COMPILER} ${CONSUMER_SOURCE_DIR}/main.cpp ${flag_list} -o ${WORK_DIR}/consumer
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "compiling the consumer with the pkg-config flags failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()
