# Dependencies of the kvcache::kvcache INTERFACE target. Used by our own build and by
# the installed package config (kvcacheConfig.cmake), so both behave the same.

find_package(xsimd 8 REQUIRED)
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
