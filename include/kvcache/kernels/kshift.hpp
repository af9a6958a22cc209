// kvcache kernels: K-shift (F6) on tiled K storage.
//
// Assumptions (checked by the caller, ops/kshift.hpp):
// - K is tiled as in format/kv_view.hpp: tile t of head h holds cells
//   [32t, 32t + 32), row-major ([row][32 cells]), rows in RoPE pair order: pair i
//   of either pair layout (normal or NeoX) is rows (2i, 2i + 1).
// - Every tile visited carries a tile_rotation: the cells of the tile that move
//   (lane mask) and where their cos/sin come from (one shared delta, or one per cell).
//
// Why it is fast: a pair of a tile is two adjacent rows of 32 cells, so one rotation
// is 16-lane multiplies of whole rows with per-lane (or broadcast) cos/sin: no
// shuffles, and the tile is walked in address order for either pair layout. When
// every moving cell of a tile shares one delta (the usual seq_add case) the cos/sin
// are broadcast scalars from a per-delta table that stays in L1, so the kernel streams
// K once (read + write in place). Lanes outside the mask are written back unchanged
// (a blend), never rotated: free cells may hold garbage. The pair loop is branch-free
// (uniform / partial are template flags): a loop over a runtime chunk count with the
// pairs' rows in arrays compiled to stack spills and ran at half the speed of the f16
// in-place bandwidth even in L2 (Zen 5: 160 vs 88 ns per tile).
#pragma once

#include <bit>          // std::countr_zero
#include <cstddef>      // std::size_t
#include <cstdint>      // fixed-width integers
#include <cmath>        // std::isfinite
#include <cstring>      // std::memcpy
#include <limits>       // infinity
#include <type_traits>  // std::true_type, std::is_same_v

#include "../concepts.hpp"
#include "../config.hpp"
#include "../element/q4_0.hpp"
#include "../element/q8_0.hpp"
#include "../format/kv_view.hpp"
#include "../simd/tile_io.hpp"

#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// How one K tile moves.
struct tile_rotation {
    std::uint32_t tile = 0;   ///< tile index (cells [32*tile, 32*tile + 32))
    tile_mask mask = 0;       ///< bit j: cell 32*tile + j moves
    bool uniform = false;     ///< every moving cell uses table `table`
    std::uint32_t table = 0;  ///< uniform: index of the delta's cos/sin table
    /// !uniform: per-lane cos/sin, [pair][k_tile] each, in caller-owned scratch.
    const float* lane_cos = nullptr;
    const float* lane_sin = nullptr;
};

/// Sub-batches of simd::lanes cells in one K tile row.
inline constexpr std::size_t kshift_batches = k_tile / simd::lanes;

namespace detail_rot {
/// x * y - z and x * y + z, each one rounding, on every instruction set with FMA. xsimd 8.1
/// has no AVX-512 fma / fms (its generic x * y -+ z let the compiler pick which product
/// to fuse, so the bits depended on the compiler); the quantized K-shift kernels below
/// reproduce these bits exactly. Without FMA (baseline x86-64): two roundings.
inline simd::fbatch fmsub(const simd::fbatch& x, const simd::fbatch& y, const simd::fbatch& z) noexcept {
#if defined(__AVX512F__)
    if constexpr (simd::lanes == 16) return _mm512_fmsub_ps(x, y, z);
#endif
    return xsimd::fms(x, y, z);
}
inline simd::fbatch fmadd(const simd::fbatch& x, const simd::fbatch& y, const simd::fbatch& z) noexcept {
#if defined(__AVX512F__)
    if constexpr (simd::lanes == 16) return _mm512_fmadd_ps(x, y, z);
#endif
    return xsimd::fma(x, y, z);
}
}  // namespace detail_rot

/// Rotates n_pairs row pairs (rows 2i and 2i + 1 from p) of a tile, all k_tile lanes of
/// each pair before the next pair, so the tile is read and written once in address order.
/// Uniform: pair i uses the scalars cs[i], sn[i]; otherwise the lanes at cs + i * k_tile,
/// sn + i * k_tile. Partial: lanes outside `keep` (one mask per sub-batch) are written
/// back unchanged. The flags are template parameters so that the loop has no branch.
/// pf (may be null): a tile rotated later; pair i asks for its bytes [i, i + 1) * pf_step.
template <bool Uniform, bool Partial, class T>
inline void rotate_rows(T* p, std::uint32_t n_pairs, const float* cs, const float* sn,
                        const xsimd::batch_bool<float> (&keep)[kshift_batches], const char* pf) noexcept {
    using simd::fbatch;
    constexpr std::size_t L = simd::lanes, B = kshift_batches;
    constexpr std::size_t step = 2 * k_tile, off = k_tile;  // elements: next pair, partner row
    constexpr std::size_t pf_step = 2 * k_tile * sizeof(T);  // bytes of one pair's two rows
#pragma GCC unroll 2
    for (std::uint32_t i = 0; i < n_pairs; ++i, p += step) {
        if (pf != nullptr)
            for (std::size_t o = 0; o < pf_step; o += 64) __builtin_prefetch(pf + std::size_t{i} * pf_step + o, 1, 3);
        for (std::size_t b = 0; b < B; ++b) {
            const fbatch x0 = simd::load(p + b * L), x1 = simd::load(p + off + b * L);
            const fbatch c = Uniform ? simd::broadcast(cs + i) : fbatch::load_unaligned(cs + std::size_t{i} * k_tile + b * L);
            const fbatch s = Uniform ? simd::broadcast(sn + i) : fbatch::load_unaligned(sn + std::size_t{i} * k_tile + b * L);
            fbatch y0 = detail_rot::fmsub(x0, c, x1 * s);  // x0 c - (x1 s), one rounding of x0 c
            fbatch y1 = detail_rot::fmadd(x0, s, x1 * c);  // x0 s + (x1 c)
            if constexpr (Partial) {
                y0 = xsimd::select(keep[b], y0, x0);
                y1 = xsimd::select(keep[b], y1, x1);
            }
            simd::store(p + b * L, y0);
            simd::store(p + off + b * L, y1);
        }
    }
}

/// Rotates one K tile of one head in place (rows [0, n_rot) in pair order).
/// cos_tab / sin_tab: n_rot / 2 floats of the uniform delta (when rot.uniform).
/// pf (may be null): a tile rotated later, whose rotated rows are prefetched meanwhile.
template <class T>
inline void rotate_tile(T* tile, std::uint32_t n_rot, const tile_rotation& rot, const float* cos_tab,
                        const float* sin_tab, const char* pf = nullptr) noexcept {
    constexpr std::size_t L = simd::lanes;
    const std::uint32_t n_pairs = n_rot / 2;
    // Lanes of sub-batch b are bits [b*L, b*L + L) of rot.mask (lane_mask reads the low L bits).
    xsimd::batch_bool<float> keep[kshift_batches];
    for (std::size_t b = 0; b < kshift_batches; ++b) keep[b] = simd::lane_mask(rot.mask >> (b * L));
    const bool partial = rot.mask != k_tile_full;
    using yes = std::true_type;
    using no = std::false_type;
    auto run = [&](auto uniform, auto part, const float* c, const float* sn) {
        rotate_rows<decltype(uniform)::value, decltype(part)::value>(tile, n_pairs, c, sn, keep, pf);
    };
    if (rot.uniform) {
        if (partial)
            run(yes{}, yes{}, cos_tab, sin_tab);
        else
            run(yes{}, no{}, cos_tab, sin_tab);
    } else {
        if (partial)
            run(no{}, yes{}, rot.lane_cos, rot.lane_sin);
        else
            run(no{}, no{}, rot.lane_cos, rot.lane_sin);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace detail_q8 {
#if defined(__AVX512F__)
using vf = __m512;  ///< one vector of floats (16 lanes with AVX-512F, 8 with AVX2)
#else
using vf = __m256;
#endif
/// Lanes per vector and vectors per 16 values (the even or odd dimensions of one block).
inline constexpr std::uint32_t vl = sizeof(vf) / sizeof(float), vpb = 16 / vl;

/// What q8_0::from_float stores for a block holding a NaN or an infinity.
inline void store_nonfinite(block_q8_0& blk) noexcept {
    blk.d = detail::block_scale(std::numeric_limits<float>::infinity(), 127.0f);
    for (auto& q : blk.qs) q = 0;
}

/// The bits of block j's stored scale; sets bit j of bad when the scale is not finite.
template <class Block>
inline std::uint16_t scale_bits(const Block& blk, std::uint32_t j, std::uint32_t& bad) noexcept {
    std::uint16_t raw;
    std::memcpy(&raw, &blk.d, sizeof raw);
    bad |= ((raw & 0x7c00u) == 0x7c00u ? 1u : 0u) << j;
    return raw;
}

/// The moving cells of a mask, in increasing order; returns how many.
inline std::uint32_t moving_cells(tile_mask mask, std::uint8_t (&cells)[k_tile]) noexcept {
    std::uint32_t n = 0;
    for (tile_mask bits = mask; bits != 0; bits &= bits - 1) cells[n++] = static_cast<std::uint8_t>(std::countr_zero(bits));
    return n;
}

/// max over the lanes of each of the 16 vectors m[j] (j < 16), as one 16-float array
/// (a transposing tree: 3 operations per pair of vectors and level, instead of a
/// horizontal reduction per vector).
inline void lane_max_16(const float (*m)[vl], float* out) noexcept {
#if defined(__AVX512F__)
    __m512 a[8], b[4], c[2];
    for (int p = 0; p < 8; ++p) {  // 256-bit halves: lanes 0-7 from m[2p], 8-15 from m[2p + 1]
        const __m512 x = _mm512_load_ps(m[2 * p]), y = _mm512_load_ps(m[2 * p + 1]);
        a[p] = _mm512_max_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int p = 0; p < 4; ++p)  // 128-bit lane q: vector 4p + q
        b[p] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; ++p)  // lane q, elements (0, 1): vector 8p + q; (2, 3): 8p + 4 + q
        c[p] = _mm512_max_ps(_mm512_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44), _mm512_shuffle_ps(b[2 * p], b[2 * p + 1], 0xEE));
    // lane q, element e: vector 4e + q; a 4x4 transpose puts vector j in lane j
    const __m512 r = _mm512_max_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i t = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_store_ps(out, _mm512_permutexvar_ps(t, r));
#else
    const __m256i t = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int h = 0; h < 2; ++h) {  // vectors 8h .. 8h + 7
        __m256 a[4], b[2];
        for (int p = 0; p < 4; ++p) {  // 128-bit lane q: vector 2p + q
            const __m256 x = _mm256_load_ps(m[8 * h + 2 * p]), y = _mm256_load_ps(m[8 * h + 2 * p + 1]);
            a[p] = _mm256_max_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
        }
        for (int p = 0; p < 2; ++p)  // lane q, elements (0, 1): vector 4p + q; (2, 3): 4p + 2 + q
            b[p] = _mm256_max_ps(_mm256_shuffle_ps(a[2 * p], a[2 * p + 1], 0x44), _mm256_shuffle_ps(a[2 * p], a[2 * p + 1], 0xEE));
        // lane q, element e: vector 2e + q
        const __m256 r = _mm256_max_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));
        _mm256_store_ps(out + 8 * h, _mm256_permutevar8x32_ps(r, t));
    }
#endif
}

/// Scales of 16 blocks from their largest |value| (amax[16]): hd[j] = binary16
/// of amax[j] / 127 (round to nearest even, as scalar::f32_to_f16) and id[j] = 1 / d as
/// q8_0::from_float computes it (0 where d is 0 or inf). Returns whether a scale is
/// subnormal (0 < d < 2^-14): only then can |y| / d exceed 127.06 (a normal d is within
/// 2^-11 of amax / 127), i.e. can a code need the clamp to +-127. Sets bit j of bad for each
/// amax[j] that is not finite (the block's stored scale was not: every value it dequantizes
/// to is then NaN or infinite, while a finite scale gives |y| < 2^24).
inline bool scales_16(const float* amax, half* hd, float* id, std::uint32_t& bad) noexcept {
    constexpr int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 q = _mm256_set1_ps(127.0f), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 min_normal = _mm256_set1_ps(6.103515625e-05f);  // 2^-14
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    int sub = 0, nonfinite = 0;
    for (int k = 0; k < 2; ++k) {
        const __m256 a = _mm256_load_ps(amax + 8 * k);
        nonfinite |= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ)) << (8 * k);
        const __m128i h = _mm256_cvtps_ph(_mm256_div_ps(a, q), rn);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hd + 8 * k), h);
        const __m256 d = _mm256_cvtph_ps(h);
        const __m256 is_zero = _mm256_cmp_ps(d, zero, _CMP_EQ_OQ);
        sub |= _mm256_movemask_ps(_mm256_andnot_ps(is_zero, _mm256_cmp_ps(d, min_normal, _CMP_LT_OQ)));
        // 1/0 = inf -> 0 (masked); 1/inf = 0 already
        _mm256_store_ps(id + 8 * k, _mm256_andnot_ps(is_zero, _mm256_div_ps(one, d)));
    }
    bad = static_cast<std::uint32_t>(nonfinite);
    return sub != 0;
}

/// cos / sin of the 16 pairs of unit row u (pairs past n_pairs: cos 1, sin 0, which
/// leave the values as they are; only the sign of a zero may change, same code).
inline void unit_angles(std::uint32_t u, std::uint32_t n_pairs, const float* cos_tab, const float* sin_tab,
                        vf (&c)[vpb], vf (&s)[vpb]) noexcept {
    const std::uint32_t i0 = u * 16, np = n_pairs - i0 < 16 ? n_pairs - i0 : 16;
#if defined(__AVX512F__)
    const __mmask16 k = static_cast<__mmask16>((1u << np) - 1u);
    c[0] = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), k, cos_tab + i0);
    s[0] = _mm512_maskz_loadu_ps(k, sin_tab + i0);
#else
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (std::uint32_t h = 0; h < vpb; ++h) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(np) - static_cast<int>(8 * h)), iota);
        c[h] = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_maskload_ps(cos_tab + i0 + 8 * h, m), _mm256_castsi256_ps(m));
        s[h] = _mm256_maskload_ps(sin_tab + i0 + 8 * h, m);
    }
#endif
}
}  // namespace detail_q8

namespace detail_q8 {
/// rotate_tile_q8_0_uniform; Full: every cell moves (block j is units[j]: no index loads, and
/// constant offsets; 5% faster per block in L1 on Zen 5).
template <bool Full>
inline void rotate_tile(block_q8_0* tile, std::uint32_t n_rot, tile_mask mask, const float* cos_tab,
                        const float* sin_tab) noexcept {
    using detail_q8::vf;
    using detail_q8::vl;
    using detail_q8::vpb;
    const std::uint32_t n_units = (n_rot + 31) / 32, n_pairs = n_rot / 2;
    std::uint8_t cells[k_tile];
    const std::uint32_t ng = detail_q8::moving_cells(mask, cells);
    alignas(64) float y[k_tile][32];  // [block][even dims (16), odd dims (16)]
    alignas(64) float m[k_tile][vl];  // lane-wise max |y|
    alignas(64) float amax[k_tile];
    alignas(64) float id[k_tile];
    half hd[k_tile];
    for (std::uint32_t j = ng; j < (ng + 15) / 16 * 16; ++j)  // (the tree reads whole groups of 16)
        for (auto& v : m[j]) v = 0.0f;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512i almost_half = _mm512_set1_epi32(0x3effffff);  // nextafter(0.5f, 0)
#if defined(__AVX512VBMI__)
    const __m512i pick = [] {  // bytes 2i, 2i + 1: the low byte of dword i of the first, the second operand
        alignas(64) std::uint8_t ix[64] = {};
        for (int i = 0; i < 16; ++i) {
            ix[2 * i] = static_cast<std::uint8_t>(4 * i);
            ix[2 * i + 1] = static_cast<std::uint8_t>(64 + 4 * i);
        }
        return _mm512_load_si512(ix);
    }();
#endif
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 almost_half = _mm256_castsi256_ps(_mm256_set1_epi32(0x3effffff));  // nextafter(0.5f, 0)
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7), min_code = _mm256_set1_epi8(-127);
    // per 128-bit lane: even codes 0-3, odd 0-3, even 4-7, odd 4-7 -> even/odd interleaved
    const __m256i inter = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                           0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
#endif
    for (std::uint32_t u = 0; u < n_units; ++u) {
        vf c[vpb], s[vpb];
        detail_q8::unit_angles(u, n_pairs, cos_tab, sin_tab, c, s);
        block_q8_0* units = tile + std::size_t{u} * k_tile;
        {
            std::uint32_t bad = 0;  // blocks whose stored scale is not finite (found in pass 2)
            // (1) dequantize, rotate (the products and fused terms of rotate_rows), max |y|
            for (std::uint32_t j = 0; j < ng; ++j) {
                const block_q8_0& blk = units[Full ? j : cells[j]];
                std::uint16_t raw;
                std::memcpy(&raw, &blk.d, sizeof raw);
#if defined(__AVX512F__)
                const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(raw)));
                const __m512i w = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs)));
                const __m512 x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24), 24)), d);
                const __m512 x1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(w, 8)), d);
                const __m512 y0 = _mm512_fmsub_ps(x0, c[0], _mm512_mul_ps(x1, s[0]));
                const __m512 y1 = _mm512_fmadd_ps(x0, s[0], _mm512_mul_ps(x1, c[0]));
                _mm512_store_ps(y[j], y0);
                _mm512_store_ps(y[j] + 16, y1);
#if defined(__AVX512DQ__)
                _mm512_store_ps(m[j], _mm512_range_ps(y0, y1, 0x0B));  // max(|y0|, |y1|), sign cleared
#else
                _mm512_store_ps(m[j], _mm512_max_ps(_mm512_abs_ps(y0), _mm512_abs_ps(y1)));
#endif
#else
                const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(raw)));
                __m256 mx = _mm256_setzero_ps();
                for (std::uint32_t h = 0; h < vpb; ++h) {  // pairs 8h .. 8h + 7
                    const __m256i w = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs + 16 * h)));
                    const __m256 x0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24)), d);
                    const __m256 x1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(w, 8)), d);
                    const __m256 y0 = _mm256_fmsub_ps(x0, c[h], _mm256_mul_ps(x1, s[h]));
                    const __m256 y1 = _mm256_fmadd_ps(x0, s[h], _mm256_mul_ps(x1, c[h]));
                    _mm256_store_ps(y[j] + 8 * h, y0);
                    _mm256_store_ps(y[j] + 16 + 8 * h, y1);
                    mx = _mm256_max_ps(mx, _mm256_max_ps(_mm256_andnot_ps(sign, y0), _mm256_andnot_ps(sign, y1)));
                }
                _mm256_store_ps(m[j], mx);
#endif
            }
            // (2) scales
            bool clamp = false;
            for (std::uint32_t h = 0; h < ng; h += 16) {
                detail_q8::lane_max_16(m + h, amax + h);
                std::uint32_t b16;
                clamp = detail_q8::scales_16(amax + h, hd + h, id + h, b16) || clamp;
                bad |= b16 << h;
            }
            // (3) codes: round(v) half away from zero = trunc(v + copysign(nextafter(0.5, 0), v)),
            // exact for every float; clamping first (or saturating after) gives the same codes.
#if defined(__AVX512F__)
            auto codes = [&](auto clamped) {
                for (std::uint32_t j = 0; j < ng; ++j) {
                    block_q8_0& blk = units[Full ? j : cells[j]];
                    const __m512 r = _mm512_set1_ps(id[j]);
                    __m512 v0 = _mm512_mul_ps(_mm512_load_ps(y[j]), r), v1 = _mm512_mul_ps(_mm512_load_ps(y[j] + 16), r);
                    if constexpr (decltype(clamped)::value) {
                        v0 = _mm512_min_ps(_mm512_max_ps(v0, lo), hi);
                        v1 = _mm512_min_ps(_mm512_max_ps(v1, lo), hi);
                    }
                    const __m512i q0 = _mm512_cvttps_epi32(_mm512_add_ps(
                        v0, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(v0), sign, almost_half, 0xEA))));
                    const __m512i q1 = _mm512_cvttps_epi32(_mm512_add_ps(
                        v1, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(v1), sign, almost_half, 0xEA))));
#if defined(__AVX512VBMI__)
                    // byte 2i = even code i, byte 2i + 1 = odd code i: the dwords' low bytes, one vpermt2b
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.qs),
                                        _mm512_castsi512_si256(_mm512_permutex2var_epi8(q0, pick, q1)));
#else
                    // word i = even code i | odd code i << 8
                    const __m512i wq = _mm512_ternarylogic_epi32(q0, _mm512_set1_epi32(0xff), _mm512_slli_epi32(q1, 8), 0xEA);
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.qs), _mm512_maskz_cvtepi32_epi16(0xffff, wq));
#endif
                    blk.d = hd[j];
                }
            };
            if (clamp)
                codes(std::true_type{});
            else
                codes(std::false_type{});
#else
            static_cast<void>(clamp);  // (the packs saturate)
            for (std::uint32_t j = 0; j < ng; ++j) {
                block_q8_0& blk = units[Full ? j : cells[j]];
                const __m256 r = _mm256_set1_ps(id[j]);
                __m256i q[4];  // even 0-7, odd 0-7, even 8-15, odd 8-15 (|v| < 2^31: no overflow)
                for (std::uint32_t k = 0; k < 4; ++k) {
                    const __m256 v = _mm256_mul_ps(_mm256_load_ps(y[j] + (k % 2) * 16 + (k / 2) * 8), r);
                    q[k] = _mm256_cvttps_epi32(_mm256_add_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), almost_half)));
                }
                // bytes per 128-bit lane: e0-3 o0-3 e8-11 o8-11 | e4-7 o4-7 e12-15 o12-15 (saturated
                // to [-128, 127]; -128 raised to -127)
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                const __m256i b = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(p, order), inter);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.qs), _mm256_max_epi8(b, min_code));
                blk.d = hd[j];
            }
#endif
            for (; bad != 0; bad &= bad - 1) [[unlikely]]
                detail_q8::store_nonfinite(units[cells[static_cast<std::uint32_t>(std::countr_zero(bad))]]);
        }
    }
}
}  // namespace detail_q8

/// q8_0 K-shift of one tile with one shared delta, in registers (AVX2 + FMA + F16C; with
/// AVX-512F, 16-lane vectors). A block holds 32 dimensions of one cell, so a pair
/// (dims 2i, 2i + 1) is two adjacent bytes: the block's 16 words are sign-extended and
/// split into the even and the odd dimensions, which rotate with plain vector
/// arithmetic (the cos / sin of the unit row's 16 pairs, no shuffles). The moving cells'
/// blocks of each rotated unit row go through three passes: (1) dequantize, rotate, keep
/// the 32 rotated values in a 4 KiB stack buffer and the lane-wise max |y|; (2) the
/// blocks' max (a transposing tree per 16 blocks), scales max / 127 rounded to binary16
/// and their inverses (one vector division and conversion per 8 blocks); (3) codes round
/// half away from zero of y / d clamped to +-127, bytes interleaved back. The arithmetic
/// (products, fused terms, roundings) is that of rotate_rows and q8_0::from_float, so the
/// bytes are identical to the generic path's (tests/kernels/test_kshift_quant.cpp). A
/// block whose stored scale is not finite becomes what from_float makes of NaN values
/// (NaN scale, zero codes), as in the generic path.
/// Why passes over the whole unit row: done block by block, the chain max -> scale ->
/// binary16 -> inverse -> codes (~110 cycles) kept too few blocks in flight (Zen 5: 9 ns
/// per block in L1); in groups of 16 blocks, pass 3 read pass 1's stores while they
/// were still in flight (5 ns); a whole unit row: 3.6 ns. The previous code also
/// converted binary16 in scalar bit code and checked every scale in a separate pass
/// (25 ns per block).
/// Tried on Zen 5 (4.1 GHz, 3.1 ns = 13 cycles per block in L1) and not faster: codes
/// picked into dword tops by vpermb (no shifts), integer maxima of |y| (no vmaxps), a tree
/// fed in registers as the blocks come, scales by gather or scalar loads, pass 3 of the
/// previous unit row run beside pass 1 of the next (software pipelining), a prefetch of
/// the next tile: each 3.1-3.4 ns. The ablations add up piece by piece (pass 1 ~4, tree
/// ~2, scales ~2, pass 3 ~4 cycles): ~45-55 instructions per block at 3.5-4.3 per cycle.
/// Measured there: one 512-bit load and one 512-bit store per cycle, vpermt2b at 1.6 per
/// cycle and competing with both the FMA and the add pipes. Later (same CPU, one tile in
/// L1): the scalar test of each stored scale replaced by the blocks' non-finite maxima in
/// pass 2, max |y| by one vrangeps, the codes packed by one vpermt2b of the two dword
/// vectors (in place of a shift, a ternary and vpmovdw): 12.3-12.7 -> 11.1 cycles per
/// block. Not faster: the scale multiply folded into the new scale (y rotated from the
/// codes, max * d, codes from y * d / d'), scales converted 16 at a time before pass 1,
/// 16-lane division in pass 2, pass loops unrolled by 2. Lambdas that capture vector
/// constants by reference must be inlined and their constants kept local: a store of
/// codes (int8, which may alias anything) made GCC reload every captured constant.
inline void rotate_tile_q8_0_uniform(block_q8_0* tile, std::uint32_t n_rot, tile_mask mask, const float* cos_tab,
                                     const float* sin_tab) noexcept {
    if (mask == k_tile_full)
        detail_q8::rotate_tile<true>(tile, n_rot, mask, cos_tab, sin_tab);
    else
        detail_q8::rotate_tile<false>(tile, n_rot, mask, cos_tab, sin_tab);
}

namespace detail_q4 {
using detail_q8::vf;
using detail_q8::vl;
using detail_q8::vpb;

/// What q4_0::from_float stores for a block holding a NaN or an infinity.
inline void store_nonfinite(block_q4_0& blk) noexcept {
    blk.d = detail::block_scale(std::numeric_limits<float>::infinity(), 8.0f);
    for (auto& q : blk.qs) q = 0x88;
}

/// The value of largest magnitude of a block as q4_0::from_float picks it (the first in
/// dimension order among equal magnitudes), as a signed magnitude: -amax when that value
/// is positive (its scale d = m / -8 is negative), +amax otherwise (+0 for a zero block).
/// y: the rotated block, [even dims (16), odd dims (16)]; amax its largest |value|.
inline float signed_max(const float* y, float amax) noexcept {
    std::uint32_t p0, p1, n0, n1;  // lanes (pairs) equal to +amax / -amax, even and odd dims
#if defined(__AVX512F__)
    const __m512 a = _mm512_set1_ps(amax), na = _mm512_set1_ps(-amax);
    const __m512 y0 = _mm512_load_ps(y), y1 = _mm512_load_ps(y + 16);
    p0 = _mm512_cmp_ps_mask(y0, a, _CMP_EQ_OQ);
    p1 = _mm512_cmp_ps_mask(y1, a, _CMP_EQ_OQ);
    n0 = _mm512_cmp_ps_mask(y0, na, _CMP_EQ_OQ);
    n1 = _mm512_cmp_ps_mask(y1, na, _CMP_EQ_OQ);
#else
    const __m256 a = _mm256_set1_ps(amax), na = _mm256_set1_ps(-amax);
    auto bits = [&](const float* v, __m256 t) {
        return static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(v), t, _CMP_EQ_OQ)) |
                                          (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(v + 8), t, _CMP_EQ_OQ)) << 8));
    };
    p0 = bits(y, a);
    p1 = bits(y + 16, a);
    n0 = bits(y, na);
    n1 = bits(y + 16, na);
#endif
    // dimension 2i is even lane i, 2i + 1 odd lane i; no match: 64 or 65, after every dimension
    auto first = [](std::uint32_t even, std::uint32_t odd) {
        const auto e = 2 * std::countr_zero(even), o = 2 * std::countr_zero(odd) + 1;
        return e < o ? e : o;
    };
    // amax = 0: every lane matches both (+0 == -0), the same first dimension: not positive
    return first(p0, p1) < first(n0, n1) ? -amax : amax;
}

/// Signed maxima of 16 blocks (as signed_max) from their largest value p[j] and largest
/// negated value n[j] (each at least +-0): -p where p > n (m positive), n where n > p,
/// +0 where both are 0; returns the blocks where p = n > 0 (a value and its negation
/// share the largest magnitude: the first in dimension order decides, signed_max).
inline std::uint32_t signed_max_16(const float* p, const float* n, float* sm) noexcept {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    std::uint32_t ties = 0;
    for (int k = 0; k < 2; ++k) {
        const __m256 a = _mm256_load_ps(p + 8 * k), b = _mm256_load_ps(n + 8 * k);
        const __m256 v = _mm256_blendv_ps(b, _mm256_xor_ps(a, sign), _mm256_cmp_ps(a, b, _CMP_GT_OQ));
        const __m256 eq = _mm256_cmp_ps(a, b, _CMP_EQ_OQ);
        _mm256_store_ps(sm + 8 * k, _mm256_andnot_ps(eq, v));  // (p = n: +0, a tie fixed by the caller)
        ties |= static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_and_ps(eq, _mm256_cmp_ps(a, zero, _CMP_GT_OQ))))
                << (8 * k);
    }
    return ties;
}

/// Scales of 16 blocks from their signed maxima (sm[16], as signed_max): hd[j] = binary16
/// of sm[j] / 8 (round to nearest even; q4_0::from_float rounds |m| / 8 and sets the sign
/// bit when m > 0, the same bits, -0 and -inf included) and id[j] = 1 / d as from_float
/// computes it (0 where d is +-0; 1 / +-inf is +-0 already, and x * +-0 + 8.5 gives code 8
/// as from_float's 0).
inline void scales_16(const float* sm, half* hd, float* id) noexcept {
    constexpr int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 q = _mm256_set1_ps(8.0f), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int k = 0; k < 2; ++k) {
        const __m128i h = _mm256_cvtps_ph(_mm256_div_ps(_mm256_load_ps(sm + 8 * k), q), rn);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hd + 8 * k), h);
        const __m256 d = _mm256_cvtph_ps(h);
        _mm256_store_ps(id + 8 * k, _mm256_andnot_ps(_mm256_cmp_ps(d, zero, _CMP_EQ_OQ), _mm256_div_ps(one, d)));
    }
}

/// Pass (1) of rotate_tile_q4_0_uniform for the moving blocks units[cells[j]], j < ng:
/// values (code - 8) * d rotated with the unit row's cos / sin c, s (rotate_rows's
/// products and fused terms) into y[j] ([even dims (16), odd dims (16)]), lane-wise
/// max(y, 0) into mp[j] and max(-y, 0) into mn[j]. Returns the blocks (bit j) whose
/// stored scale is not finite.
template <bool Full>
inline std::uint32_t rotate_blocks(const block_q4_0* units, const std::uint8_t* cells, std::uint32_t ng,
                                   const vf (&c)[vpb], const vf (&s)[vpb], float (*y)[32], float (*mp)[vl],
                                   float (*mn)[vl]) noexcept {
#if defined(__AVX512F__)
    const __m512i low4 = _mm512_set1_epi32(0xf), eight = _mm512_set1_epi32(8);
    const __m512i nib = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);  // pairs 8-15: high nibbles
    const __m512 zero = _mm512_setzero_ps();
#else
    const __m256i low4 = _mm256_set1_epi32(0xf), eight = _mm256_set1_epi32(8);
    const __m256 sign = _mm256_set1_ps(-0.0f);
#endif
    std::uint32_t bad = 0;
    for (std::uint32_t j = 0; j < ng; ++j) {
        const block_q4_0& blk = units[Full ? j : cells[j]];
        const std::uint16_t raw = detail_q8::scale_bits(blk, j, bad);
        const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
#if defined(__AVX512F__)
        const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(raw)));
        const __m512i w = _mm512_srlv_epi32(_mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(words)), nib);
        const __m512 x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(w, low4), eight)), d);
        const __m512 x1 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(w, 8), low4), eight)), d);
        const __m512 y0 = _mm512_fmsub_ps(x0, c[0], _mm512_mul_ps(x1, s[0]));
        const __m512 y1 = _mm512_fmadd_ps(x0, s[0], _mm512_mul_ps(x1, c[0]));
        _mm512_store_ps(y[j], y0);
        _mm512_store_ps(y[j] + 16, y1);
        _mm512_store_ps(mp[j], _mm512_max_ps(_mm512_max_ps(y0, y1), zero));
        _mm512_store_ps(mn[j], _mm512_max_ps(_mm512_max_ps(_mm512_sub_ps(zero, y0), _mm512_sub_ps(zero, y1)), zero));
#else
        const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(raw)));
        const __m256i w8 = _mm256_cvtepu16_epi32(words);
        __m256 px = _mm256_setzero_ps(), nx = _mm256_setzero_ps();
        for (std::uint32_t h = 0; h < detail_q4::vpb; ++h) {  // pairs 8h .. 8h + 7
            const __m256i w = _mm256_srli_epi32(w8, static_cast<int>(4 * h));
            const __m256 x0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, low4), eight)), d);
            const __m256 x1 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(w, 8), low4), eight)), d);
            const __m256 y0 = _mm256_fmsub_ps(x0, c[h], _mm256_mul_ps(x1, s[h]));
            const __m256 y1 = _mm256_fmadd_ps(x0, s[h], _mm256_mul_ps(x1, c[h]));
            _mm256_store_ps(y[j] + 8 * h, y0);
            _mm256_store_ps(y[j] + 16 + 8 * h, y1);
            px = _mm256_max_ps(px, _mm256_max_ps(y0, y1));
            nx = _mm256_max_ps(nx, _mm256_max_ps(_mm256_xor_ps(sign, y0), _mm256_xor_ps(sign, y1)));
        }
        _mm256_store_ps(mp[j], px);
        _mm256_store_ps(mn[j], nx);
#endif
    }
    return bad;
}
}  // namespace detail_q4

namespace detail_q4 {
/// rotate_tile_q4_0_uniform; Full: every cell moves (block j is units[j]).
template <bool Full>
inline void rotate_tile(block_q4_0* tile, std::uint32_t n_rot, tile_mask mask, const float* cos_tab,
                        const float* sin_tab) noexcept {
    const std::uint32_t n_units = (n_rot + 31) / 32, n_pairs = n_rot / 2;
    std::uint8_t cells[k_tile];
    const std::uint32_t ng = detail_q8::moving_cells(mask, cells);
    alignas(64) float y[k_tile][32];  // [block][even dims (16), odd dims (16)]
    alignas(64) float mp[k_tile][detail_q4::vl];  // lane-wise max y (at least 0)
    alignas(64) float mn[k_tile][detail_q4::vl];  // lane-wise max -y (at least 0)
    alignas(64) float pmax[k_tile];
    alignas(64) float nmax[k_tile];
    alignas(64) float sm[k_tile];
    alignas(64) float id[k_tile];
    half hd[k_tile];
    for (std::uint32_t j = ng; j < (ng + 15) / 16 * 16; ++j) {  // (the tree reads whole groups of 16)
        for (auto& v : mp[j]) v = 0.0f;
        for (auto& v : mn[j]) v = 0.0f;
    }
#if defined(__AVX512F__)
    const __m512i nib = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);  // pairs 8-15: high nibbles
    const __m512 half8 = _mm512_set1_ps(8.5f), zero = _mm512_setzero_ps(), top = _mm512_set1_ps(15.0f);
#else
    const __m256 half8 = _mm256_set1_ps(8.5f), zero = _mm256_setzero_ps(), top = _mm256_set1_ps(15.0f);
#endif
    for (std::uint32_t u = 0; u < n_units; ++u) {
        block_q4_0* units = tile + std::size_t{u} * k_tile;
        detail_q4::vf c[detail_q4::vpb], s[detail_q4::vpb];
        detail_q8::unit_angles(u, n_pairs, cos_tab, sin_tab, c, s);
        // (1) dequantize, rotate, max y and max -y; bad: blocks whose stored scale is not finite
        std::uint32_t bad = detail_q4::rotate_blocks<Full>(units, cells, ng, c, s, y, mp, mn);
        // (2) block maxima, their signs, scales
        for (std::uint32_t h = 0; h < ng; h += 16) {
            detail_q8::lane_max_16(mp + h, pmax + h);
            detail_q8::lane_max_16(mn + h, nmax + h);
            for (std::uint32_t ties = detail_q4::signed_max_16(pmax + h, nmax + h, sm + h); ties != 0; ties &= ties - 1) {
                const std::uint32_t j = h + static_cast<std::uint32_t>(std::countr_zero(ties));
                sm[j] = detail_q4::signed_max(y[j], pmax[j]);
            }
            detail_q4::scales_16(sm + h, hd + h, id + h);
        }
        // (3) codes, nibbles packed back
        for (std::uint32_t j = 0; j < ng; ++j) {
            block_q4_0& blk = units[Full ? j : cells[j]];
#if defined(__AVX512F__)
            const __m512 r = _mm512_set1_ps(id[j]);
            const __m512 v0 = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(_mm512_load_ps(y[j]), r, half8), zero), top);
            const __m512 v1 = _mm512_min_ps(_mm512_max_ps(_mm512_fmadd_ps(_mm512_load_ps(y[j] + 16), r, half8), zero), top);
            // lane p: even code | odd code << 8; pairs 8-15 move to the high nibbles of lanes 0-7
            const __m512i w = _mm512_sllv_epi32(
                _mm512_or_si512(_mm512_cvttps_epi32(v0), _mm512_slli_epi32(_mm512_cvttps_epi32(v1), 8)), nib);
            const __m512i t = _mm512_or_si512(w, _mm512_shuffle_i64x2(w, w, 0x4E));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(blk.qs),
                             _mm256_castsi256_si128(_mm512_maskz_cvtepi32_epi16(0xffff, t)));
#else
            const __m256 r = _mm256_set1_ps(id[j]);
            __m256i w[2];
            for (std::uint32_t h = 0; h < 2; ++h) {
                const __m256 v0 = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(_mm256_load_ps(y[j] + 8 * h), r, half8), zero), top);
                const __m256 v1 =
                    _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(_mm256_load_ps(y[j] + 16 + 8 * h), r, half8), zero), top);
                w[h] = _mm256_or_si256(_mm256_cvttps_epi32(v0), _mm256_slli_epi32(_mm256_cvttps_epi32(v1), 8));
            }
            const __m256i t = _mm256_or_si256(w[0], _mm256_slli_epi32(w[1], 4));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(blk.qs),
                             _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
#endif
            blk.d = hd[j];
        }
        for (; bad != 0; bad &= bad - 1) [[unlikely]]
            detail_q4::store_nonfinite(units[cells[static_cast<std::uint32_t>(std::countr_zero(bad))]]);
    }
}
}  // namespace detail_q4

/// q4_0 K-shift of one tile with one shared delta, in registers (AVX2 + FMA + F16C; with
/// AVX-512F, 16-lane vectors): the passes of rotate_tile_q8_0_uniform, with q4_0's
/// packing and rules. Byte 2t of a block holds dims 2t (low nibble) and 2t + 16 (high),
/// byte 2t + 1 dims 2t + 1 and 2t + 17: the 8 words of a block, zero-extended and
/// shifted right by 4 for pairs 8-15, give the even dims (bits 0-3) and the odd dims
/// (bits 8-11) of the 16 pairs in pair order, so the cos / sin are loaded as for q8_0.
/// (1) values (code - 8) * d, rotated with rotate_rows's products and fused terms, kept
/// with the lane-wise max of y and of -y; (2) per block the largest value p and largest
/// negated value n (two transposing trees): m = p if p > n, -n if n > p (the scale
/// d = m / -8), and where p = n > 0 the first of the two in dimension order (from_float's
/// tie rule, signed_max, run for those blocks only); scales rounded to binary16 and
/// their inverses; (3) codes
/// floor(fma(y, 1 / d, 8.5)) clamped to [0, 15] (clamping before the truncation gives
/// the same codes), nibbles packed back. So the bytes are q4_0::from_float's of the
/// generic path's rotated values (tests/kernels/test_kshift_quant.cpp). A block whose
/// stored scale is not finite becomes what from_float makes of NaN values (NaN scale,
/// codes 8).
/// Why two trees: finding the first value of largest magnitude of every block (four
/// compares and bit scans each) cost 9 ns per block, 1,100 of 1,580 ns per tile (Zen 5,
/// L1, head dim 128); the trees and the rare ties: 690 ns (q8_0: 400 ns).
inline void rotate_tile_q4_0_uniform(block_q4_0* tile, std::uint32_t n_rot, tile_mask mask, const float* cos_tab,
                                     const float* sin_tab) noexcept {
    if (mask == k_tile_full)
        detail_q4::rotate_tile<true>(tile, n_rot, mask, cos_tab, sin_tab);
    else
        detail_q4::rotate_tile<false>(tile, n_rot, mask, cos_tab, sin_tab);
}
#endif

/// K-shift of one tile for an element without SIMD storage (the generic path): each row
/// pair is converted with Element::to_float into a stack buffer, rotated by the same
/// f32 code as the native path, and the moving cells are converted back with
/// Element::from_float (cells outside rot.mask keep their stored bytes). Allocates nothing.
///
/// Block elements (block_size 32, format/kv_view.hpp "Block elements"): each unit row
/// holding rotated rows (32 rows x 32 cells) is dequantized into a 4 KiB stack buffer,
/// transposed to [row][cell], rotated in f32 with the exact angles, and each moving
/// cell's unit is quantized again (its rows >= n_rot too, with the unit's new scale).
template <class Element>
inline void rotate_tile_converted(typename Element::storage_type* tile, std::uint32_t n_rot,
                                  const tile_rotation& rot, const float* cos_tab, const float* sin_tab) noexcept {
    using T = typename Element::storage_type;
    if constexpr (element_block_size_v<Element> > 1) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if constexpr (std::is_same_v<T, block_q8_0>)
            if (rot.uniform) {
                rotate_tile_q8_0_uniform(tile, n_rot, rot.mask, cos_tab, sin_tab);
                return;
            }
        if constexpr (std::is_same_v<T, block_q4_0>)
            if (rot.uniform) {
                rotate_tile_q4_0_uniform(tile, n_rot, rot.mask, cos_tab, sin_tab);
                return;
            }
#endif
        constexpr std::uint32_t B = element_block_size_v<Element>;
        static_assert(B == k_tile, "kvcache: the tiled layouts store block_size 1 or 32");
        const xsimd::batch_bool<float> keep[kshift_batches] = {};  // (unused: Partial = false)
        alignas(64) float buf[B * k_tile];  // [row][cell]
        alignas(64) float col[B];
        const std::uint32_t n_pairs = n_rot / 2;
        for (std::uint32_t u = 0; u * B < n_rot; ++u) {
            T* units = tile + std::size_t{u} * k_tile;
            for (std::uint32_t j = 0; j < k_tile; ++j) {
                Element::to_float(units + j, col, B);
                for (std::uint32_t i = 0; i < B; ++i) buf[std::size_t{i} * k_tile + j] = col[i];
            }
            const std::uint32_t i0 = u * B / 2;  // first pair of this unit row
            const std::uint32_t np = n_pairs - i0 < B / 2 ? n_pairs - i0 : B / 2;
            if (rot.uniform)
                rotate_rows<true, false>(buf, np, cos_tab + i0, sin_tab + i0, keep, nullptr);
            else
                rotate_rows<false, false>(buf, np, rot.lane_cos + std::size_t{i0} * k_tile,
                                          rot.lane_sin + std::size_t{i0} * k_tile, keep, nullptr);
            for (tile_mask bits = rot.mask; bits != 0; bits &= bits - 1) {
                const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
                for (std::uint32_t i = 0; i < B; ++i) col[i] = buf[std::size_t{i} * k_tile + j];
                Element::from_float(col, units + j, B);
            }
        }
        return;
    }
    constexpr std::size_t pair = 2 * std::size_t{k_tile};  // values of one row pair
    const xsimd::batch_bool<float> keep[kshift_batches] = {};  // (unused: the whole pair is rotated)
    const bool partial = rot.mask != k_tile_full;
    alignas(64) float buf[pair];
    T back[element_block_size_v<Element> == 1 ? pair : 1];
    for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
        T* p = tile + std::size_t{i} * pair;
        Element::to_float(p, buf, pair);
        if (rot.uniform)
            rotate_rows<true, false>(buf, 1, cos_tab + i, sin_tab + i, keep, nullptr);
        else
            rotate_rows<false, false>(buf, 1, rot.lane_cos + std::size_t{i} * k_tile,
                                      rot.lane_sin + std::size_t{i} * k_tile, keep, nullptr);
        if (!partial) {
            Element::from_float(buf, p, pair);
            continue;
        }
        Element::from_float(buf, back, pair);
        for (tile_mask bits = rot.mask; bits != 0; bits &= bits - 1) {
            const auto j = static_cast<std::uint32_t>(std::countr_zero(bits));
            p[j] = back[j];
            p[k_tile + j] = back[k_tile + j];
        }
    }
}

/// Plain scalar K-shift of one tile (the reference path the benchmarks compare against).
template <class T, class ToFloat, class FromFloat>
inline void rotate_tile_scalar(T* tile, std::uint32_t n_rot, const tile_rotation& rot, const float* cos_tab,
                               const float* sin_tab, ToFloat to_f, FromFloat from_f) noexcept {
    for (std::uint32_t j = 0; j < k_tile; ++j) {
        if (!((rot.mask >> j) & 1u)) continue;
        for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
            const std::uint32_t d0 = 2 * i, d1 = 2 * i + 1;  // rows of pair i
            const float c = rot.uniform ? cos_tab[i] : rot.lane_cos[std::size_t{i} * k_tile + j];
            const float s = rot.uniform ? sin_tab[i] : rot.lane_sin[std::size_t{i} * k_tile + j];
            T& a = tile[std::size_t{d0} * k_tile + j];
            T& b = tile[std::size_t{d1} * k_tile + j];
            const float x0 = to_f(a), x1 = to_f(b);
            a = from_f(x0 * c - x1 * s);
            b = from_f(x0 * s + x1 * c);
        }
    }
}

}  // namespace kernels
KVCACHE_END_NAMESPACE
