// kvcache kernels: K-shift (F6) on tiled K storage.
//
// Assumptions (checked by the caller, ops/kshift.hpp):
// - K is tiled as in layout/kv_storage.hpp: tile t of head h holds cells
//   [16t, 16t + 16), dimension-major ([d][16 cells]).
// - Every tile visited carries a tile_rotation: the cells of the tile that move
//   (lane mask) and where their cos/sin come from (one shared delta, or one per cell).
//
// Why it is fast: a pair (d0, d1) of a tile is two rows of 16 cells, so one
// rotation is 16-lane multiplies of whole rows with per-lane (or broadcast) cos/sin:
// no shuffles for either pair layout (normal or NeoX only changes which rows pair
// up). When every moving cell of a tile shares one delta (the usual seq_add case)
// the cos/sin are broadcast scalars from a per-delta table that stays in L1, so the
// kernel streams K once (read + write in place). Lanes outside the mask are written
// back unchanged (a blend), never rotated: free cells may hold garbage.
#pragma once

#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers

#include "../config.hpp"
#include "../layout/kv_storage.hpp"
#include "../model_shape.hpp"
#include "../simd/tile_io.hpp"
#include "rope_angles.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// How one K tile moves.
struct tile_rotation {
    std::uint32_t tile = 0;   ///< tile index (cells [16*tile, 16*tile + 16))
    std::uint16_t mask = 0;   ///< bit j: cell 16*tile + j moves
    bool uniform = false;     ///< every moving cell uses table `table`
    std::uint32_t table = 0;  ///< uniform: index of the delta's cos/sin table
    /// !uniform: per-lane cos/sin, [pair][16] each, in caller-owned scratch.
    const float* lane_cos = nullptr;
    const float* lane_sin = nullptr;
};

/// Rotates one K tile of one head in place.
/// cos_tab / sin_tab: n_pairs floats of the uniform delta (when rot.uniform).
template <class T>
inline void rotate_tile(T* tile, std::uint32_t n_rot, rope_type type, const tile_rotation& rot,
                        const float* cos_tab, const float* sin_tab) noexcept {
    using simd::fbatch;
    constexpr std::size_t L = simd::lanes;
    const std::uint32_t n_pairs = n_rot / 2;
    const bool full = rot.mask == 0xffffu;
    // Per-batch lane masks: lanes of sub-batch b are bits [b*L, b*L + L) of rot.mask.
    for (std::size_t b = 0; b < k_tile / L; ++b) {
        const auto sub = static_cast<std::uint32_t>((rot.mask >> (b * L)) & ((1u << L) - 1u));
        if (sub == 0) continue;
        const auto keep = simd::lane_mask(sub);
        // Pairs in chunks of CH: all loads of a chunk first, so that NeoX (whose partner
        // rows are half a tile apart) reads CH consecutive rows of each half in one burst
        // instead of alternating between the halves row by row.
        constexpr std::uint32_t CH = 8;
        for (std::uint32_t i0 = 0; i0 < n_pairs; i0 += CH) {
            const std::uint32_t nc = n_pairs - i0 < CH ? n_pairs - i0 : CH;
            fbatch x0[CH], x1[CH];
            T* r0[CH];
            T* r1[CH];
            for (std::uint32_t u = 0; u < nc; ++u) {
                std::uint32_t d0, d1;
                rope_pair(type, n_rot, i0 + u, d0, d1);
                r0[u] = tile + std::size_t{d0} * k_tile + b * L;
                r1[u] = tile + std::size_t{d1} * k_tile + b * L;
                x0[u] = simd::load(r0[u]);
            }
            for (std::uint32_t u = 0; u < nc; ++u) x1[u] = simd::load(r1[u]);
            for (std::uint32_t u = 0; u < nc; ++u) {
                const std::uint32_t i = i0 + u;
                fbatch c, s;
                if (rot.uniform) {
                    c = fbatch(cos_tab[i]);
                    s = fbatch(sin_tab[i]);
                } else {
                    c = fbatch::load_unaligned(rot.lane_cos + std::size_t{i} * k_tile + b * L);
                    s = fbatch::load_unaligned(rot.lane_sin + std::size_t{i} * k_tile + b * L);
                }
                fbatch y0 = xsimd::fms(x0[u], c, x1[u] * s);
                fbatch y1 = xsimd::fma(x0[u], s, x1[u] * c);
                if (!full) {
                    y0 = xsimd::select(keep, y0, x0[u]);
                    y1 = xsimd::select(keep, y1, x1[u]);
                }
                x0[u] = y0;
                x1[u] = y1;
            }
            for (std::uint32_t u = 0; u < nc; ++u) simd::store(r0[u], x0[u]);
            for (std::uint32_t u = 0; u < nc; ++u) simd::store(r1[u], x1[u]);
        }
    }
}

/// Plain scalar K-shift of one tile (the reference path the benchmarks compare against).
template <class T, class ToFloat, class FromFloat>
inline void rotate_tile_scalar(T* tile, std::uint32_t n_rot, rope_type type, const tile_rotation& rot,
                               const float* cos_tab, const float* sin_tab, ToFloat to_f, FromFloat from_f) noexcept {
    for (std::uint32_t j = 0; j < k_tile; ++j) {
        if (!((rot.mask >> j) & 1u)) continue;
        for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
            std::uint32_t d0, d1;
            rope_pair(type, n_rot, i, d0, d1);
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
