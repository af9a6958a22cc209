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
#include <type_traits>  // std::true_type, std::is_same_v

#include "../concepts.hpp"
#include "../config.hpp"
#include "../element/q8_0.hpp"
#include "../format/kv_view.hpp"
#include "../simd/tile_io.hpp"

#if defined(__AVX2__) && defined(__FMA__)
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
            fbatch y0 = xsimd::fms(x0, c, x1 * s);
            fbatch y1 = xsimd::fma(x0, s, x1 * c);
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

#if defined(__AVX2__) && defined(__FMA__)
/// q8_0 K-shift of one tile with one shared delta, in registers (AVX2 + FMA; AVX-512
/// builds use the same 8-lane code): for each unit row u and each moving cell, its block
/// (32 dimensions of the cell) is dequantized into four 8-lane vectors, each pair
/// (dims 2i, 2i + 1, adjacent in the block) rotated with the pair-swapped vector, then
/// requantized with the same arithmetic as q8_0::from_float (scale from max|y| rounded to
/// binary16, round half away from zero, clamp to +-127): the bytes are identical to the
/// generic path's. Returns false (nothing written) when a moving block's scale is not
/// finite: the generic path then handles the tile.
inline bool rotate_tile_q8_0_uniform(block_q8_0* tile, std::uint32_t n_rot, tile_mask mask, const float* cos_tab,
                                     const float* sin_tab) noexcept {
    constexpr std::uint32_t B = 32;
    const std::uint32_t n_units = (n_rot + B - 1) / B;
    for (std::uint32_t u = 0; u < n_units; ++u)
        for (tile_mask bits = mask; bits != 0; bits &= bits - 1)
            if (!std::isfinite(scalar::f16_to_f32(tile[std::size_t{u} * k_tile + static_cast<std::uint32_t>(std::countr_zero(bits))].d)))
                return false;
    const std::uint32_t n_pairs = n_rot / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f), half_v = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 qmax = _mm256_set1_ps(127.0f), qmin = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (std::uint32_t u = 0; u < n_units; ++u) {
        // cos / sin of the unit's 16 pairs, each repeated for its two dimensions (pairs past
        // n_rot: cos 1, sin 0, which leaves them as they are)
        alignas(32) float cd[B], sd[B];
        for (std::uint32_t k = 0; k < B / 2; ++k) {
            const std::uint32_t i = u * (B / 2) + k;
            cd[2 * k] = cd[2 * k + 1] = i < n_pairs ? cos_tab[i] : 1.0f;
            sd[2 * k] = sd[2 * k + 1] = i < n_pairs ? sin_tab[i] : 0.0f;
        }
        block_q8_0* units = tile + std::size_t{u} * k_tile;
        for (tile_mask bits = mask; bits != 0; bits &= bits - 1) {
            block_q8_0& blk = units[static_cast<std::uint32_t>(std::countr_zero(bits))];
            const __m256 d = _mm256_set1_ps(scalar::f16_to_f32(blk.d));
            __m256 y[4];
            __m256 amax = _mm256_setzero_ps();
            for (int k = 0; k < 4; ++k) {
                const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8 * k));
                const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
                const __m256 xs = _mm256_permute_ps(x, 0xB1);  // partners: dims 2i <-> 2i + 1
                const __m256 c = _mm256_load_ps(cd + 8 * k), sn = _mm256_load_ps(sd + 8 * k);
                const __m256 even = _mm256_fmsub_ps(x, c, _mm256_mul_ps(xs, sn));  // x0 c - x1 s
                const __m256 odd = _mm256_fmadd_ps(xs, sn, _mm256_mul_ps(x, c));   // x0 s + x1 c
                y[k] = _mm256_blend_ps(even, odd, 0xAA);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, y[k]));
            }
            __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
            const half hd = detail::block_scale(_mm_cvtss_f32(m), 127.0f);
            const float dn = scalar::f16_to_f32(hd);
            const __m256 id = _mm256_set1_ps(dn != 0.0f && std::isfinite(dn) ? 1.0f / dn : 0.0f);
            __m256i q[4];
            for (int k = 0; k < 4; ++k) {
                const __m256 v = _mm256_mul_ps(y[k], id);
                const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                const __m256 frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));  // exact
                const __m256 up = _mm256_and_ps(_mm256_cmp_ps(frac, half_v, _CMP_GE_OQ),
                                                _mm256_or_ps(one, _mm256_and_ps(sign, v)));  // +-1 away from zero
                const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, up), qmin), qmax);
                q[k] = _mm256_cvtps_epi32(r);  // integral already: exact
            }
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            blk.d = hd;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.qs), _mm256_permutevar8x32_epi32(p, order));
        }
    }
    return true;
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
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<T, block_q8_0>)
            if (rot.uniform && rotate_tile_q8_0_uniform(tile, n_rot, rot.mask, cos_tab, sin_tab)) return;
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
