# Checks the layering of include/kvcache: a header may include headers of its own
# layer or of layers earlier in this list, never a later one. Run with
# -DINCLUDE_DIR=<path to include/kvcache>.
# Bottom-up: "name:member,member" where a member is a top-level file or folder.
set(layers
  "basics:config.hpp,error.hpp,model_shape.hpp,concepts.hpp,detail" "tokens:tokens" "simd:simd"
  "element:element" "format:format" "cells:cells" "layout:layout" "reuse:reuse" "memory:memory"
  "kernels:kernels" "ops:ops" "io:io" "tier:tier" "prompt:prompt" "umbrella:kvcache.hpp")

# Layer index of a path relative to include/kvcache (first component or file name).
function(layer_of rel out)
  string(REGEX REPLACE "/.*" "" first "${rel}")
  set(i 0)
  foreach(entry IN LISTS layers)
    string(REGEX REPLACE "^[^:]*:" "" members "${entry}")
    string(REPLACE "," ";" members "${members}")
    foreach(m IN LISTS members)
      if(first STREQUAL m)
        set(${out} ${i} PARENT_SCOPE)
        return()
      endif()
    endforeach()
    math(EXPR i "${i} + 1")
  endforeach()
  set(${out} -1 PARENT_SCOPE)
endfunction()


file(GLOB_RECURSE headers RELATIVE ${INCLUDE_DIR} ${INCLUDE_DIR}/*.hpp)
set(bad 0)
foreach(rel IN LISTS headers)
  layer_of("${rel}" mine)
  if(mine LESS 0)
    message(SEND_ERROR "${rel}: in no layer of tests/headers/check_layering.cmake; add its folder there and to the README source tree")
    set(bad 1)
    continue()
  endif()
  get_filename_component(dir "${INCLUDE_DIR}/${rel}" DIRECTORY)
  file(STRINGS "${INCLUDE_DIR}/${rel}" incs REGEX "^#include \"")
  foreach(line IN LISTS incs)
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" inc "${line}")
    get_filename_component(abs "${dir}/${inc}" ABSOLUTE)
    file(RELATIVE_PATH target_rel ${INCLUDE_DIR} ${abs})
    layer_of("${target_rel}" theirs)
    if(theirs GREATER mine)
      message(SEND_ERROR "${rel} includes ${target_rel}, a later layer")
      set(bad 1)
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "include/kvcache layering broken (see above)")
endif()
list(LENGTH headers n)
message(STATUS "layering holds for ${n} headers")
