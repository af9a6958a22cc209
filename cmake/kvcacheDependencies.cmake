# Dependencies of the kvcache::kvcache INTERFACE target. Used by our own build and by
# the installed package config (kvcacheConfig.cmake), so both behave the same.

# Loaded by the installed kvcacheConfig.cmake, a missing dependency makes find_package(kvcache)
# report kvcache not found, with the reason (find_dependency, which also passes on the
# caller's QUIET / REQUIRED); in our own build it stops the configure.
if(CMAKE_FIND_PACKAGE_NAME STREQUAL "kvcache")
  include(CMakeFindDependencyMacro)
  find_dependency(xsimd 8)
else()
  find_package(xsimd 8 REQUIRED)
endif()
# Debian 12's xsimd 8.1 exports a target whose INTERFACE_LINK_LIBRARIES names `xtl`,
# a library that is not installed (xtl is header-only and optional for xsimd).
# Without a real `xtl` target, drop it, or every consumer fails with `cannot find -lxtl`.
if(TARGET xsimd AND NOT TARGET xtl)
  get_target_property(_kvcache_xsimd_libs xsimd INTERFACE_LINK_LIBRARIES)
  if(_kvcache_xsimd_libs)
    list(REMOVE_ITEM _kvcache_xsimd_libs xtl)
    set_target_properties(xsimd PROPERTIES INTERFACE_LINK_LIBRARIES "${_kvcache_xsimd_libs}")
  endif()
  unset(_kvcache_xsimd_libs)
endif()

# OpenMP is optional: kernels compile serially without it (KVCACHE_OMP macro).
find_package(OpenMP COMPONENTS CXX QUIET)

# xxhash (Debian libxxhash-dev): the state files (io/, included by kvcache.hpp) hash with
# it, inline from <xxhash.h> (nothing to link). Checked here so that a missing header is
# named at configure time, not found later as a compile error in a kvcache header.
find_path(KVCACHE_XXHASH_INCLUDE_DIR xxhash.h)
if(NOT KVCACHE_XXHASH_INCLUDE_DIR)
  set(_kvcache_xxhash_msg "kvcache needs xxhash.h (Debian: apt-get install libxxhash-dev): state files hash with it")
  if(CMAKE_FIND_PACKAGE_NAME STREQUAL "kvcache")
    set(kvcache_FOUND FALSE)
    set(kvcache_NOT_FOUND_MESSAGE "${_kvcache_xxhash_msg}")
    return()
  endif()
  message(FATAL_ERROR "${_kvcache_xxhash_msg}")
endif()
mark_as_advanced(KVCACHE_XXHASH_INCLUDE_DIR)
