// kvcache simd: load / store xsimd float batches from f32, f16 and bf16 storage.
//
// The kernels do all arithmetic on xsimd::batch<float> of the arch the including
// translation unit was compiled for. These helpers move one batch between a storage
// array and registers. With AVX-512 the 16-bit paths are one conversion
// instruction; otherwise they go through kvcache's conversion helper (simd/convert.hpp)
// and a small stack buffer. Loads and stores are unaligned and touch exactly
// batch::size elements (no tail handling here: callers pass full batches).
#pragma once

#include <xsimd/xsimd.hpp>

#include <bit>      // std::bit_cast
#include <cstddef>  // std::size_t
#include <cstdint>  // std::uint32_t

#include "../config.hpp"
#include "convert.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

using fbatch = xsimd::batch<float>;
inline constexpr std::size_t lanes = fbatch::size;

/// Loads lanes elements starting at p as floats.
inline fbatch load(const float* p) noexcept { return fbatch::load_unaligned(p); }

inline fbatch load(const half* p) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#if defined(__F16C__) && defined(__AVX__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
    alignas(64) float tmp[lanes];
    f16_to_f32(p, tmp, lanes);
    return fbatch::load_aligned(tmp);
}

inline fbatch load(const bfloat16* p) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
#endif
    alignas(64) float tmp[lanes];
    bf16_to_f32(p, tmp, lanes);
    return fbatch::load_aligned(tmp);
}

/// The float at p in every lane. With AVX-512 this is `vpbroadcastd zmm, m32`, written
/// out because compilers emit `vbroadcastss` or fold the broadcast into an FMA operand
/// (`{1to16}`), and on Zen 4 both slow down loops that also load and convert K / V
/// while the integer form does not. In L1, a score step of 2 f16 K rows, 4 broadcasts
/// and 8 FMAs ran at 0.75 of the FMA rate with `vbroadcastss`, 0.39 with `{1to16}` and
/// 1.00 with this (bench/README.md, "Broadcasts on Zen 4"). Same lanes, same bits: only
/// the instruction differs.
inline fbatch broadcast(const float* p) noexcept {
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
    if constexpr (lanes == 16) {
        // The empty asm keeps the compiler from turning the integer broadcast back into
        // the float one (a memory operand on the asm would make GCC spill accumulators).
        __m512i v = _mm512_set1_epi32(std::bit_cast<std::int32_t>(*p));
        __asm__("" : "+v"(v));
        return _mm512_castsi512_ps(v);
    }
#endif
    return fbatch(*p);
}

/// Stores a batch into lanes elements at p, rounding to nearest even for 16-bit types.
inline void store(float* p, const fbatch& v) noexcept { v.store_unaligned(p); }

inline void store(half* p, const fbatch& v) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                            _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
#endif
#if defined(__F16C__) && defined(__AVX__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
    }
#endif
    alignas(64) float tmp[lanes];
    v.store_aligned(tmp);
    f32_to_f16(tmp, p, lanes);
}

inline void store(bfloat16* p, const fbatch& v) noexcept {
    // Integer rounding to nearest even, NaN quietened (as scalar::f32_to_bf16).
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) {
        const __m256i x = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                               _mm256_set1_epi32(0x7f800000));
        const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(x, _mm256_set1_epi32(0x00400000)), nan);
        const __m256i hi = _mm256_srli_epi32(r, 16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
        return;
    }
#endif
    alignas(64) float tmp[lanes];
    v.store_aligned(tmp);
    f32_to_bf16(tmp, p, lanes);
}

/// One element as float (scalar conversion).
inline float to_float(float x) noexcept { return x; }
inline float to_float(half x) noexcept { return scalar::f16_to_f32(x); }
inline float to_float(bfloat16 x) noexcept { return scalar::bf16_to_f32(x); }

/// n elements at src, src + stride, ... converted to dst[0, n).
template <class T>
inline void to_floats(const T* src, std::size_t stride, float* dst, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(src[i * stride]);
}

/// Lane mask from bits (bit j: lane j).
inline xsimd::batch_bool<float> lane_mask(std::uint32_t bits) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) return xsimd::batch_bool<float>(static_cast<__mmask16>(bits));
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) {  // lane j: all ones when bit j is set (no trip through memory)
        const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<std::int32_t>(bits)), sel);
        return xsimd::batch_bool<float>(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel)));
    }
#endif
    alignas(64) bool b[lanes];
    for (std::size_t j = 0; j < lanes; ++j) b[j] = ((bits >> j) & 1u) != 0;
    return xsimd::batch_bool<float>::load_aligned(b);
}

/// exp(x) for x <= 80 (including -inf; NaN gives NaN), relative error ~2e-7: 2^(x log2 e) split into
/// 2^n (exponent bits) times a degree-6 polynomial for 2^f, f in [-1/2, 1/2]. Arguments
/// below -87 give about 2^-126 instead of a subnormal or 0; callers mask lanes that
/// must be exactly 0. Cheaper than a general exp: no overflow or NaN handling needed.
inline fbatch exp_bounded(const fbatch& x) noexcept {
    using ibatch = xsimd::batch<std::int32_t>;
    // max(-126, t) in this operand order returns t when t is NaN (x86 MAXPS returns its
    // second operand when either is NaN): a NaN logit, or the NaN of inf - inf, stays NaN.
    const fbatch t = xsimd::max(fbatch(-126.0f), x * fbatch(1.44269504088896341f));
    const fbatch n = xsimd::nearbyint(t);
    const fbatch f = t - n;
    fbatch p(1.5403530393381610e-4f);  // ln(2)^k / k!, k = 6 .. 0
    p = xsimd::fma(p, f, fbatch(1.3333558146428443e-3f));
    p = xsimd::fma(p, f, fbatch(9.6181291076284772e-3f));
    p = xsimd::fma(p, f, fbatch(5.5504108664821580e-2f));
    p = xsimd::fma(p, f, fbatch(2.4022650695910071e-1f));
    p = xsimd::fma(p, f, fbatch(6.9314718055994531e-1f));
    p = xsimd::fma(p, f, fbatch(1.0f));
    const ibatch e = xsimd::to_int(n) << 23;
    return xsimd::bitwise_cast<fbatch>(xsimd::bitwise_cast<ibatch>(p) + e);
}

#if defined(__AVX512F__)
/// Transposes a 16 x 16 block of floats held as 16 rows in place (AVX-512 builds only:
/// 64 in-register shuffles, for the attention kernel's query buffer).
inline void transpose16(__m512 (&r)[16]) noexcept {
    __m512 t[16];
    // Pairs of rows a, b: (a0 b0 a1 b1) and (a2 b2 a3 b3) in each 128-bit lane.
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m512 u[16];  // u[4g + e]: rows 4g..4g+3, element e of each 128-bit lane
    for (int g = 0; g < 4; ++g) {
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    // Column 4 * lane + e is 128-bit lane `lane` of u[e], u[4 + e], u[8 + e], u[12 + e].
    for (int e = 0; e < 4; ++e) {
        const __m512 v = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);
        const __m512 w = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xdd);
        const __m512 x = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 y = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xdd);
        r[e] = _mm512_shuffle_f32x4(v, x, 0x88);
        r[8 + e] = _mm512_shuffle_f32x4(v, x, 0xdd);
        r[4 + e] = _mm512_shuffle_f32x4(w, y, 0x88);
        r[12 + e] = _mm512_shuffle_f32x4(w, y, 0xdd);
    }
}
#endif

#if defined(__AVX2__)
/// Transposes an 8 x 8 block of floats held as 8 rows in place (24 in-register shuffles).
inline void transpose8(__m256 (&r)[8]) noexcept {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; ++g) {  // u[4g + e]: rows 4g..4g+3, element e of each 128-bit lane
        u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int e = 0; e < 4; ++e) {
        r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
        r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
    }
}
#endif

/// True when some lane of x is above thr or either is NaN (`!(x <= thr)`, one compare:
/// the online softmax's "max moved" test, which must also catch NaN logits).
inline bool any_above_or_nan(const fbatch& x, const fbatch& thr) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) return _mm512_cmp_ps_mask(x, thr, _CMP_NLE_UQ) != 0;
#endif
#if defined(__AVX__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) return _mm256_movemask_ps(_mm256_cmp_ps(x, thr, _CMP_NLE_UQ)) != 0;
#endif
    return xsimd::any(!(x <= thr));
}

/// True when some lane is NaN. (Not `x != x`: xsimd compiles != to the ordered
/// compare _CMP_NEQ_OQ on AVX / AVX-512, which is false for NaN.)
inline bool any_nan(const fbatch& x) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0;
#endif
#if defined(__AVX__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0;
#endif
    alignas(64) float t[lanes];
    x.store_aligned(t);
    bool nan = false;
    for (std::size_t j = 0; j < lanes; ++j) nan = nan || t[j] != t[j];
    return nan;
}

/// Largest lane (NaN lanes may or may not be seen: test any_nan first where it matters).
inline float hmax(const fbatch& v) noexcept {
#if defined(__AVX512F__)
    if constexpr (lanes == 16) return _mm512_reduce_max_ps(v);
#endif
#if defined(__AVX__) && !defined(__AVX512F__)
    if constexpr (lanes == 8) {
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        return _mm_cvtss_f32(m);
    }
#endif
    alignas(64) float t[lanes];
    v.store_aligned(t);
    float m = t[0];
    for (std::size_t j = 1; j < lanes; ++j) m = t[j] > m ? t[j] : m;
    return m;
}

}  // namespace simd
KVCACHE_END_NAMESPACE
