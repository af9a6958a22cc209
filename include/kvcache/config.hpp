// kvcache: configuration macros, version and the library namespace.
// Every macro here may be defined by the user before the first kvcache include.
#pragma once

#include <cstdio>   // std::fprintf for the default assertion handler
#include <cstdlib>  // std::abort

#define KVCACHE_VERSION_MAJOR 0
#define KVCACHE_VERSION_MINOR 1
#define KVCACHE_VERSION_PATCH 0

/// Largest number of sequences a cache can track (size of the per-cell
/// sequence bitset). Must be a multiple of 64.
#ifndef KVCACHE_MAX_SEQ
#define KVCACHE_MAX_SEQ 256
#endif
static_assert(KVCACHE_MAX_SEQ > 0 && KVCACHE_MAX_SEQ % 64 == 0,
              "KVCACHE_MAX_SEQ must be a positive multiple of 64");

/// The instruction sets the inline code was compiled for. Kernels, conversions and the
/// checksum choose their code with #if on these macros, so two translation units built
/// with different -m flags compile different bodies for the same inline function; the
/// ABI namespace below carries this tag so that the linker never merges them.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVCACHE_ISA_TAG avx512bw
#elif defined(__AVX512F__)
#define KVCACHE_ISA_TAG avx512f
#elif defined(__AVX2__) && defined(__F16C__)
#define KVCACHE_ISA_TAG avx2_f16c
#elif defined(__AVX2__)
#define KVCACHE_ISA_TAG avx2
#elif defined(__F16C__)
#define KVCACHE_ISA_TAG f16c
#elif defined(__AVX__)
#define KVCACHE_ISA_TAG avx
#else
#define KVCACHE_ISA_TAG generic
#endif

#define KVCACHE_CAT_(a, b) a##b
#define KVCACHE_CAT(a, b) KVCACHE_CAT_(a, b)
/// Versioned, ABI-tagged inline namespace: version, instruction sets (KVCACHE_ISA_TAG) and
/// KVCACHE_MAX_SEQ, e.g. kvcache::v0_1_avx512bw_s256. Objects built against another
/// version, with other -m flags or another KVCACHE_MAX_SEQ cannot be mixed at link time by
/// accident (the one-definition rule would otherwise be broken silently).
#define KVCACHE_ABI_NAMESPACE KVCACHE_CAT(KVCACHE_CAT(v0_1_, KVCACHE_ISA_TAG), KVCACHE_CAT(_s, KVCACHE_MAX_SEQ))
#define KVCACHE_BEGIN_NAMESPACE \
    namespace kvcache {         \
    inline namespace KVCACHE_ABI_NAMESPACE {
#define KVCACHE_END_NAMESPACE \
    }                         \
    }

/// Assertion for programming errors (broken preconditions inside the library).
/// Invalid arguments from the host are never asserted: they throw kvcache::error.
#ifndef KVCACHE_ASSERT
#ifdef NDEBUG
#define KVCACHE_ASSERT(cond) static_cast<void>(0)
#else
#define KVCACHE_ASSERT(cond)                                                       \
    ((cond) ? static_cast<void>(0)                                                  \
            : (std::fprintf(stderr, "kvcache: assertion failed: %s (%s:%d)\n", #cond, \
                            __FILE__, __LINE__),                                    \
               std::abort()))
#endif
#endif

/// OpenMP goes through this one macro so that a build without OpenMP compiles
/// the same code serially. Usage: KVCACHE_OMP(parallel for schedule(static))
#ifndef KVCACHE_OMP
#if defined(_OPENMP)
#define KVCACHE_DO_PRAGMA(x) _Pragma(#x)
#define KVCACHE_OMP(directive) KVCACHE_DO_PRAGMA(omp directive)
#else
#define KVCACHE_OMP(directive)
#endif
#endif

#if defined(_OPENMP)
#include <omp.h>  // omp_get_thread_num etc. for kernels that split work by hand
#endif

KVCACHE_BEGIN_NAMESPACE
/// Threads a kernel call uses: n > 0 as asked, otherwise the OpenMP default; 1 without OpenMP.
inline int resolve_threads(int n) noexcept {
#if defined(_OPENMP)
    return n > 0 ? n : omp_get_max_threads();
#else
    static_cast<void>(n);
    return 1;
#endif
}

/// True on Intel x86 CPUs (checked once). The kernels pick their prefetch strategy by it
/// where Intel and AMD cores measured differently (bench/README.md).
inline bool cpu_is_intel() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    static const bool intel = __builtin_cpu_is("intel");
    return intel;
#else
    return false;
#endif
}
KVCACHE_END_NAMESPACE
