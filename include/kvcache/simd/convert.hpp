// kvcache: f16 / bf16 <-> f32 conversion, scalar and vectorised.
//
// The one helper through which all 16-bit float conversion goes. xsimd 8.1 has no
// fp16 batch, so the vector paths use raw intrinsics chosen by the compiler flags
// of the including translation unit (F16C / AVX-512F / AVX2). The scalar path is
// always available (namespace scalar) and is what tests compare against.
// All paths round to nearest even and keep Inf, NaN (quietened) and subnormals.
#pragma once

#include <bit>      // std::bit_cast
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // F16C / AVX2 / AVX-512 intrinsics
#endif

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// IEEE 754 binary16 storage type (not an arithmetic type).
enum class half : std::uint16_t {};
/// bfloat16 storage type: the upper 16 bits of an IEEE binary32.
enum class bfloat16 : std::uint16_t {};

namespace scalar {

/// binary32 -> binary16, round to nearest even, NaN stays NaN (quiet), overflow -> Inf.
constexpr half f32_to_f16(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // Inf or NaN
        const std::uint32_t nan = abs > 0x7f800000u ? (0x0200u | ((abs >> 13) & 0x3ffu)) : 0u;
        return static_cast<half>(sign | 0x7c00u | nan);
    }
    if (abs >= 0x477ff000u) return static_cast<half>(sign | 0x7c00u);  // rounds to >= 65520: Inf
    if (abs >= 0x38800000u) {  // normal half range (>= 2^-14)
        const std::uint32_t mant_odd = (abs >> 13) & 1u;
        const std::uint32_t r = (abs + 0xfffu + mant_odd) >> 13;  // RNE on the 13 dropped bits
        return static_cast<half>(sign | (r - (112u << 10)));      // rebias exponent 127 -> 15
    }
    if (abs < 0x33000000u) return static_cast<half>(sign);  // < 2^-25: rounds to zero
    // Subnormal half: value = m * 2^-24 with m in [0, 1024].
    const std::uint32_t e = abs >> 23;                 // biased exponent, 102..112
    const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;  // 24-bit significand
    const std::uint32_t shift = 126u - e;              // 14..24
    const std::uint32_t q = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    const std::uint32_t rounded = q + ((rem > halfway || (rem == halfway && (q & 1u))) ? 1u : 0u);
    return static_cast<half>(sign | rounded);
}

/// binary16 -> binary32 (exact).
constexpr float f16_to_f32(half h) noexcept {
    const std::uint32_t x = static_cast<std::uint16_t>(h);
    const std::uint32_t sign = (x & 0x8000u) << 16;
    const std::uint32_t exp = (x >> 10) & 0x1fu;
    std::uint32_t mant = x & 0x3ffu;
    if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return std::bit_cast<float>(sign);
    // Subnormal: normalise.
    std::uint32_t e = 113u;
    while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --e;
    }
    return std::bit_cast<float>(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

/// binary32 -> bfloat16, round to nearest even, NaN stays NaN (quiet).
constexpr bfloat16 f32_to_bf16(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<bfloat16>((x >> 16) | 0x0040u);
    const std::uint32_t r = x + 0x7fffu + ((x >> 16) & 1u);
    return static_cast<bfloat16>(r >> 16);
}

/// bfloat16 -> binary32 (exact).
constexpr float bf16_to_f32(bfloat16 b) noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(static_cast<std::uint16_t>(b)) << 16);
}

inline void f16_to_f32(const half* src, float* dst, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
inline void f32_to_f16(const float* src, half* dst, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
inline void bf16_to_f32(const bfloat16* src, float* dst, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
inline void f32_to_bf16(const float* src, bfloat16* dst, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

}  // namespace scalar

/// Which vector path this translation unit compiled in (for tests and benches).
constexpr const char* convert_path() noexcept {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__F16C__) && defined(__AVX2__)
    return "f16c+avx2";
#elif defined(__F16C__)
    return "f16c";
#else
    return "scalar";
#endif
}

// Vector paths. Loop tails are done by the scalar code: no out-of-bounds reads.

inline void f16_to_f32(const half* src, float* dst, std::size_t n) noexcept {
    std::size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    scalar::f16_to_f32(src + i, dst + i, n - i);
}

inline void f32_to_f16(const float* src, half* dst, std::size_t n) noexcept {
    std::size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            // maskz form: GCC 12 warns about the unmasked form's undefined source.
                            _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(src + i),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    scalar::f32_to_f16(src + i, dst + i, n - i);
}

inline void bf16_to_f32(const bfloat16* src, float* dst, std::size_t n) noexcept {
    std::size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    scalar::bf16_to_f32(src + i, dst + i, n - i);
}

inline void f32_to_bf16(const float* src, bfloat16* dst, std::size_t n) noexcept {
    std::size_t i = 0;
    // Integer rounding (not VCVTNEPS2BF16, which flushes subnormals to zero).
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x00400000);
    for (; i + 16 <= n; i += 16) {
        const __m512i x = _mm512_castps_si512(_mm512_loadu_ps(src + i));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, bias), lsb);
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, abs_mask), inf);
        r = _mm512_mask_or_epi32(r, nan, x, quiet);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
#elif defined(__AVX2__)
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x00400000);
    for (; i + 8 <= n; i += 8) {
        const __m256i x = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
        const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(x, bias), lsb);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
        const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(x, quiet), nan);
        const __m256i hi = _mm256_srli_epi32(r, 16);  // values fit in 16 bits: pack without saturation
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
    }
#endif
    scalar::f32_to_bf16(src + i, dst + i, n - i);
}

KVCACHE_END_NAMESPACE
