// kvcache io: moving K/V between a layout's storage (format/kv_view.hpp) and the
// state format's K tiles and V rows (format.hpp), hashing what is saved on the way.
#pragma once

#include <algorithm>  // std::min
#include <cstddef>    // std::byte, std::size_t
#include <cstdint>    // fixed-width integers
#include <cstring>    // std::memcpy, std::memset
#include <optional>   // checked sizes
#include <span>       // cell maps
#include <vector>     // copy plans

#include "../detail/policy_select.hpp"
#include "../format/kv_view.hpp"
#include "detail/xxhash.hpp"
#include "fingerprint.hpp"
#include "format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {

using kvcache::detail::internal_access;
using kvcache::detail::make_error;

/// How the K/V of saved cell i (format order) maps to cell map[i] of the storage. A
/// format K tile (state_k_lanes cells) whose cells are 16 consecutive storage cells
/// starting at a multiple of 16 is one aligned part of a storage tile: each of its rows
/// moves as one 16-lane memcpy. Runs of consecutive V rows become single memcpys.
struct copy_plan {
    struct run {
        std::uint32_t from;  ///< first saved format tile (K) or saved cell (V)
        std::uint32_t to;    ///< first storage 16-cell group (K) or cell (V); unused for lane segments
        std::uint32_t len;   ///< format tiles (K) or cells (V)
        bool lanes;          ///< K: one saved tile whose cells are copied one by one
    };
    std::vector<run> k_segs;  ///< every saved format tile in order: runs of aligned tiles, or lane segments
    std::vector<run> v_runs;  ///< every saved cell in order: consecutive saved cells in consecutive storage cells
    std::uint32_t n_cells = 0;
    std::uint32_t n_tiles = 0;  ///< format tiles: ceil(n_cells / state_k_lanes)
};
static_assert(k_tile % state_k_lanes == 0, "a format K tile must be an aligned part of a storage K tile");

/// Appends {from, to, 1} to runs, or extends the last run when both sides continue it.
inline void add_to_run(std::vector<copy_plan::run>& runs, std::uint32_t from, std::uint32_t to, bool lanes) {
    if (!lanes && !runs.empty() && !runs.back().lanes && runs.back().from + runs.back().len == from &&
        runs.back().to + runs.back().len == to)
        ++runs.back().len;
    else
        runs.push_back({from, to, 1, lanes});
}

inline copy_plan make_copy_plan(std::span<const std::uint32_t> map) {
    copy_plan p;
    p.n_cells = static_cast<std::uint32_t>(map.size());
    constexpr std::uint32_t w = state_k_lanes;
    p.n_tiles = (p.n_cells + w - 1) / w;
    for (std::uint32_t t = 0; t < p.n_tiles; ++t) {
        const std::uint32_t first = t * w;
        bool aligned = first + w <= p.n_cells && map[first] % w == 0;
        for (std::uint32_t j = 1; aligned && j < w; ++j) aligned = map[first + j] == map[first] + j;
        add_to_run(p.k_segs, t, aligned ? map[first] / w : 0, !aligned);
    }
    for (std::uint32_t i = 0; i < p.n_cells; ++i) add_to_run(p.v_runs, i, map[i], false);
    return p;
}

/// Bytes of one layer's K (all heads) and V (all heads) in the format.
struct layer_sizes {
    std::uint64_t k_head, v_head, layer;
};

inline std::optional<layer_sizes> sizes_for(const fingerprint& f, std::uint64_t n_cells) {
    const std::uint64_t tiles = (n_cells + state_k_lanes - 1) / state_k_lanes;
    const std::uint32_t b = elem_unit_values(f.elem_size);  // values per unit (block elements)
    if (f.head_dim_k % b != 0 || f.head_dim_v % b != 0) return std::nullopt;
    const auto k_elems = mul_u64(tiles, std::uint64_t{state_k_lanes} * (f.head_dim_k / b));
    const auto v_elems = mul_u64(n_cells, f.head_dim_v / b);
    if (!k_elems || !v_elems) return std::nullopt;
    const auto k_head = mul_u64(*k_elems, elem_unit_bytes(f.elem_size));
    const auto v_head = mul_u64(*v_elems, elem_unit_bytes(f.elem_size));
    if (!k_head || !v_head) return std::nullopt;
    const auto kv = add_u64(*k_head, *v_head);
    if (!kv) return std::nullopt;
    const auto layer = mul_u64(*kv, f.n_head_kv);
    if (!layer) return std::nullopt;
    return layer_sizes{*k_head, *v_head, *layer};
}

/// Moves one layer's K/V between the storage cells in `map` and the format bytes at
/// `fmt`: Save copies storage -> format and feeds the format bytes to `hash` in file
/// order, in chunks small enough to be hashed while still in cache; !Save copies
/// format -> storage. T is const for Save. Block elements move whole storage units
/// (format.hpp: K unit rows in the cache's row order, V units in dimension order).
template <bool Save, class T, class B>
void transfer_layer(const kv_layer_view<T>& v, const copy_plan& p, std::span<const std::uint32_t> map, B* fmt,
                    hasher* hash) {
    constexpr std::size_t es = sizeof(T);
    auto move = [&](std::size_t f, T* s, std::size_t n) {  // n bytes at format offset f <-> storage s
        if constexpr (Save)
            std::memcpy(fmt + f, s, n);
        else
            std::memcpy(s, fmt + f, n);
    };
    auto hashed = [&](std::size_t f, std::size_t n) {
        if constexpr (Save) hash->update(fmt + f, n);
    };
    constexpr std::uint32_t w = state_k_lanes;
    const std::uint32_t kr = v.k_units(), lg = v.block_log2;  // K rows (unit rows) of a tile
    const std::size_t tile_bytes = std::size_t{w} * kr * es;  // one format K tile
    const std::size_t row_bytes = std::size_t{v.v_units()} * es;
    // Storage row of format row r: dimension order -> RoPE pair order for values, the same
    // unit row for block elements.
    auto srow = [&v, lg](std::uint32_t r) { return lg == 0 ? v.k_row(r) : r; };
    // A format tile's rows are 16 lanes of one dimension, in dimension order; in the
    // storage they are part of a k_tile-wide row, in RoPE pair order (format/kv_view.hpp,
    // which differs for NeoX): an aligned tile moves row by row, 16 lanes at a time.
    std::size_t at = 0;  // format offset of the current head's K or V block
    for (std::uint32_t h = 0; h < v.n_head_kv; ++h, at += std::size_t{p.n_tiles} * tile_bytes) {
        for (const auto& sg : p.k_segs) {
            const std::size_t f0 = at + sg.from * tile_bytes;
            if (!sg.lanes) {
                for (std::uint32_t t = 0; t < sg.len; ++t) {
                    const std::uint32_t c0 = (sg.to + t) * w;  // first storage cell
                    T* part = v.k_tile_ptr(h, c0 / k_tile) + c0 % k_tile;
                    const std::size_t ft = f0 + t * tile_bytes;
                    for (std::uint32_t d = 0; d < kr; ++d)
                        move(ft + std::size_t{d} * w * es, part + std::size_t{srow(d)} * k_tile, w * es);
                    hashed(ft, tile_bytes);
                }
                continue;
            }
            const std::uint32_t n = std::min(w, p.n_cells - sg.from * w);
            if constexpr (Save)
                if (n < w) std::memset(fmt + f0, 0, tile_bytes);  // lanes past n_cells stay zero
            std::size_t base[w];  // dimension d of lane j is at v.k[base[j] + k_row(d) * k_tile]
            for (std::uint32_t j = 0; j < n; ++j) base[j] = v.k_offset(h, map[sg.from * w + j], 0);
            for (std::uint32_t d = 0; d < kr; ++d)
                for (std::uint32_t j = 0; j < n; ++j)
                    move(f0 + (std::size_t{d} * w + j) * es, v.k + base[j] + std::size_t{srow(d)} * k_tile, es);
            hashed(f0, tile_bytes);
        }
    }
    for (std::uint32_t h = 0; h < v.n_head_kv; ++h, at += std::size_t{p.n_cells} * row_bytes) {
        if (v.vl == v_layout::row_major) {
            // The format's V rows are whole; the storage keeps each tile's rows as blocks of
            // v_block dimensions (format/kv_view.hpp). Per stretch of a run inside one
            // storage tile (at most 32 cells, 8 KiB for f16 heads of 128): block by block,
            // so the storage side of each block is one contiguous run and the format side
            // stays in L1, then the stretch is hashed while it is still there.
            for (const auto& r : p.v_runs) {
                for (std::uint32_t i = 0; i < r.len;) {
                    const std::uint32_t c0 = r.to + i;
                    const std::uint32_t seg = std::min(r.len - i, k_tile - c0 % k_tile);
                    const std::size_t f0 = at + (std::size_t{r.from} + i) * row_bytes;
                    for (std::uint32_t d0 = 0; d0 < v.dim_v; d0 += v_block) {
                        T* piece = v.v + v.v_offset(h, c0, d0);  // cells c0.. of this block, back to back
                        const std::uint32_t w = std::min(v_block, v.dim_v - d0);
                        if (w == v_block && lg == 0) {
                            for (std::uint32_t j = 0; j < seg; ++j)
                                move(f0 + j * row_bytes + d0 * es, piece + std::size_t{j} * v_block, v_block * es);  // constant size: inlined
                        } else {
                            const std::uint32_t wu = w >> lg;  // units of this block per cell
                            for (std::uint32_t j = 0; j < seg; ++j)
                                move(f0 + j * row_bytes + (d0 >> lg) * es, piece + std::size_t{j} * wu, wu * es);
                        }
                    }
                    hashed(f0, std::size_t{seg} * row_bytes);
                    i += seg;
                }
            }
            continue;
        }
        for (std::uint32_t i = 0; i < p.n_cells; ++i) {
            for (std::uint32_t u = 0; u < v.v_units(); ++u)
                move(at + i * row_bytes + u * es, v.v + v.v_unit(h, map[i], u), es);
            hashed(at + i * row_bytes, row_bytes);
        }
    }
}

}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE
