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
        for (std::uint32_t i = 0; i < n_pairs; ++i) {
            std::uint32_t d0, d1;
            rope_pair(type, n_rot, i, d0, d1);
            T* r0 = tile + std::size_t{d0} * k_tile + b * L;
            T* r1 = tile + std::size_t{d1} * k_tile + b * L;
            const fbatch x0 = simd::load(r0), x1 = simd::load(r1);
            fbatch c, s;
            if (rot.uniform) {
                c = fbatch(cos_tab[i]);
                s = fbatch(sin_tab[i]);
            } else {
                c = fbatch::load_unaligned(rot.lane_cos + std::size_t{i} * k_tile + b * L);
                s = fbatch::load_unaligned(rot.lane_sin + std::size_t{i} * k_tile + b * L);
            }
            fbatch y0 = xsimd::fms(x0, c, x1 * s);
            fbatch y1 = xsimd::fma(x0, s, x1 * c);
            if (!full) {
                y0 = xsimd::select(keep, y0, x0);
                y1 = xsimd::select(keep, y1, x1);
            }
            simd::store(r0, y0);
            simd::store(r1, y1);
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
