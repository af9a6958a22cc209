# Flags for kvcache's own tests, benchmarks and examples (never on the INTERFACE target).

include(CheckCXXCompilerFlag)
check_cxx_compiler_flag(-march=native KVCACHE_HAS_MARCH_NATIVE)

# kvcache_warnings: strict warnings for everything we compile ourselves.
add_library(kvcache_warnings INTERFACE)
target_compile_options(kvcache_warnings INTERFACE -Wall -Wextra -Werror -Wno-psabi)

# kvcache_native: what benchmarks, examples and SIMD tests build with.
# KVCACHE_ARCH_FLAGS overrides -march=native, e.g. "-march=x86-64-v4;-mf16c" for a
# binary that runs on another machine.
set(KVCACHE_ARCH_FLAGS "" CACHE STRING "arch flags for benchmarks/examples/SIMD tests (default -march=native)")
add_library(kvcache_native INTERFACE)
if(KVCACHE_ARCH_FLAGS)
  target_compile_options(kvcache_native INTERFACE ${KVCACHE_ARCH_FLAGS})
elseif(KVCACHE_HAS_MARCH_NATIVE)
  target_compile_options(kvcache_native INTERFACE -march=native)
endif()
# GCC 12.2 (Debian 12) reports -W(maybe-)uninitialized inside its own AVX-512 intrinsic
# headers (_mm512_undefined_* sources, GCC PR105593, fixed in 12.3), e.g. when xxHash's
# AVX-512 path is inlined: silence both there.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 12.3)
  target_compile_options(kvcache_native INTERFACE -Wno-maybe-uninitialized -Wno-uninitialized)
endif()

# kvcache_sanitize: ASan + UBSan when KVCACHE_SANITIZE=ON.
add_library(kvcache_sanitize INTERFACE)
if(KVCACHE_SANITIZE)
  target_compile_options(kvcache_sanitize INTERFACE
    -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(kvcache_sanitize INTERFACE -fsanitize=address,undefined)
endif()
