// kvcache: the physical K/V format (tiles, V blocks, views) that layouts write and
// kernels and state files read. Nothing here allocates or knows about cells.
//
// Why this arrangement (it decides how fast the kernels can be):
// - Head-major: every KV head of a layer owns one contiguous run of cells, so
//   attention streams one head's K and V rows sequentially, and all query heads
//   of a GQA group read them once.
// - K is tiled: cells are grouped in tiles of k_tile = 32 and, inside a tile, K is
//   stored one dimension per row ([row][32 cells]). q.K for 32 cells is then FMAs of a
//   broadcast q[d] with one contiguous row (two 16-lane vectors): no horizontal
//   reduction per cell. The K-shift applies the same 2x2 rotation to 32 cells at once.
//   Why 32 and not 16 (one vector): a broadcast query element then feeds two FMAs
//   instead of one, and the score loop was limited by the broadcasts, not by the FMAs
//   (Zen 5: 0.71-0.78 cycles per FMA with one, ~0.53 with two or more); an f16 row is
//   then exactly one 64-byte line. L2-resident decode ran 22% faster and 512 x 512
//   prefill 6-8% (bench/README.md, "K tiles of 32 cells").
// - K rows are stored in RoPE pair order: the two dimensions a rotation mixes are
//   adjacent rows. For normal RoPE (pairs (2i, 2i+1)) that is dimension order; for
//   NeoX (pairs (i, i + n_rot/2)) dimension i is row 2i and dimension i + n_rot/2 is
//   row 2i + 1 (dimensions >= n_rot keep their row). The K-shift then walks every
//   tile in address order for both pair layouts: NeoX in dimension order walked two
//   streams half a tile apart and ran at 0.75-0.9 of the in-place bandwidth on Zen 5
//   against 1.0-1.2 for normal RoPE. Attention permutes q the same way (q.K is a sum
//   over dimensions, so only the pairing of q[d] with K row k_row(d) matters), and
//   state files keep dimension order (io/format.hpp).
// - V is row-major per head (each cell's row of dim_v values, the "flash" layout) or
//   transposed ([d][cell], llama.cpp's non-flash layout), chosen by the layout policy.
//   Row-major V is blocked like K: a 32-cell tile holds its rows as blocks of
//   v_block = 64 dimensions, [block][32 cells][64] (the last block narrower when 64
//   does not divide dim_v). Decode reads K and V of a tile together, K rows and one
//   cell's 64-dimension piece of V per step (two K rows per piece for D = 128), and with
//   four query heads a block's 4 x 4 accumulators stay in registers, so each broadcast
//   probability feeds four FMAs; in this order the tile's V is one sequential stream.
//   Plain [cell][d] rows would be read 64 bytes per cell with 192-byte gaps, and
//   reading K and V one after the other left a Zen 5 core at 0.7-0.85 of its read
//   bandwidth (bench/README.md, "Reading K and V together"). Blocks of 32 dimensions
//   (before 2026-11-25) fed two FMAs per broadcast; on Zen 4, whose float broadcasts
//   then limited one core's decode, 64 made 1-thread decode 1.05x faster
//   (bench/README.md, "V blocks of 64 dimensions"; the integer broadcasts that followed
//   gave another 1.15x, "Broadcasts on Zen 4").
//
// Element offsets (cp = cells rounded up to a multiple of k_tile; b = d / 64 * 64,
// w = min(64, dim_v - b)):
//   K(l, h, c, d) = l*k_layer_stride + h*k_head_stride + (c / 32)*32*dim_k + k_row(d)*32 + c % 32
//   V(l, h, c, d) = l*v_layer_stride + h*v_head_stride + (c / 32)*32*dim_v + b*32 + (c % 32)*w + d - b
//                                                                              (row-major)
//                 = l*v_layer_stride + h*v_head_stride + d*cp + c             (transposed)
// with k_head_stride = cp*dim_k, v_head_stride = cp*dim_v.
//
// Block elements (element block_size 32: q8_0, q4_0): one storage unit holds 32 values of
// ONE cell (a block with its scale), so every cell's bytes stay its own (writing, copying,
// backing up or loading one cell never touches another cell's bytes, as with the plain
// elements). Offsets are then in units; with b = block_size (requires dim_k % 32 == 0 and
// dim_v % 32 == 0):
//   K unit (h, c, row-block u) = h*k_head_stride + (c / 32)*32*(dim_k/b) + u*32 + c % 32,
//     holding rows [32u, 32u + 32) (RoPE pair order: a NeoX pair never straddles two units)
//   V unit (row-major)  = ... + (c / 32)*32*(dim_v/b) + v_in_tile(c % 32, d) / b
//     (each cell's piece of a 64-dimension V block is w/b consecutive units)
//   V unit (transposed) = h*v_head_stride + (d / b)*cp + c
// with k_head_stride = cp*dim_k/b, v_head_stride = cp*dim_v/b. So a K tile is
// [dim_k/b unit rows][32 cells], the same shape as a plain tile with rows of 32 values
// each; the value at dimension d is lane k_row(d) % b of its K unit, lane d % b of its V
// unit. Bytes per 32 values: values_bytes<Element>(32) (element/contract.hpp).
// Why blocks along the head dimension (per token) and not along the 32 cells of a K row
// (per channel, KIVI): a per-channel block's scale is shared by 32 cells that may belong
// to different sequences, and writing one cell would re-quantize the other 31.
#pragma once

#include <cstddef>  // std::size_t
#include <cstdint>  // std::uint32_t

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Cells per K tile (two 512-bit vectors of f32 lanes; see "K is tiled" above).
inline constexpr std::uint32_t k_tile = 32;

/// Dimensions per V block: row-major V stores each 32-cell tile as blocks of v_block
/// dimensions, [block][32 cells][v_block] (see "V is row-major" above).
inline constexpr std::uint32_t v_block = 64;

/// One bit per cell of a K tile.
using tile_mask = std::uint32_t;
/// Every cell of a K tile.
inline constexpr tile_mask k_tile_full = ~tile_mask{0};
static_assert(k_tile == 8 * sizeof(tile_mask), "a tile_mask has one bit per cell of a K tile");

/// How V rows are stored (F9).
enum class v_layout : std::uint8_t {
    row_major = 0,   ///< a row per cell (flash-style attention), tiles of 32 cells in blocks of 64 dimensions
    transposed = 1,  ///< [head][d][cell]: llama.cpp's non-flash layout (V^T . p as a GEMV)
};

/// Raw view of one layer's K and V for kernels. T may be const-qualified.
template <class T>
struct kv_layer_view {
    T* k = nullptr;               ///< K tiles of head 0 (see offsets above)
    T* v = nullptr;               ///< V of head 0
    std::uint32_t n_head_kv = 0;
    std::uint32_t dim_k = 0;
    std::uint32_t dim_v = 0;
    std::uint32_t n_cells_pad = 0;  ///< cells allocated, a multiple of k_tile
    std::size_t k_head_stride = 0;  ///< elements between heads in k
    std::size_t v_head_stride = 0;  ///< elements between heads in v
    v_layout vl = v_layout::row_major;
    std::uint32_t neox_rot = 0;     ///< n_rot when K rows are in NeoX pair order, else 0
    std::uint32_t block_log2 = 0;   ///< log2 of the values per storage unit (0, or 5 for block elements)

    /// Values per storage unit: 1, or 32 for block elements (see "Block elements" above).
    [[nodiscard]] std::uint32_t block() const noexcept { return 1u << block_log2; }
    /// Storage units of one cell's K row of one head (dim_k / block()).
    [[nodiscard]] std::uint32_t k_units() const noexcept { return dim_k >> block_log2; }
    /// Storage units of one cell's V row of one head (dim_v / block()).
    [[nodiscard]] std::uint32_t v_units() const noexcept { return dim_v >> block_log2; }

    /// Row of dimension d inside a K tile (see "RoPE pair order" above).
    [[nodiscard]] std::uint32_t k_row(std::uint32_t d) const noexcept {
        const std::uint32_t half = neox_rot / 2;
        if (d >= neox_rot) return d;
        return d < half ? 2 * d : 2 * (d - half) + 1;
    }
    /// First element of K tile `tile` (cells [32*tile, 32*tile + 32)) of head h: dim_k rows of 32.
    [[nodiscard]] T* k_tile_ptr(std::uint32_t h, std::uint32_t tile) const noexcept {
        return k + h * k_head_stride + std::size_t{tile} * k_tile * k_units();
    }
    /// Offset of the K unit holding element (h, cell, dimension d) (the element itself
    /// when block() == 1).
    [[nodiscard]] std::size_t k_offset(std::uint32_t h, std::uint32_t c, std::uint32_t d) const noexcept {
        return k_unit(h, c, k_row(d) >> block_log2);
    }
    /// Offset of K unit u of (h, cell): rows [u*block(), (u+1)*block()) (u < k_units()).
    [[nodiscard]] std::size_t k_unit(std::uint32_t h, std::uint32_t c, std::uint32_t u) const noexcept {
        return h * k_head_stride + std::size_t{c / k_tile} * k_tile * k_units() + std::size_t{u} * k_tile + c % k_tile;
    }
    /// Row-major V: first element of tile `tile` (cells [32*tile, 32*tile + 32)) of head h.
    [[nodiscard]] T* v_tile_ptr(std::uint32_t h, std::uint32_t tile) const noexcept {
        return v + h * v_head_stride + std::size_t{tile} * k_tile * v_units();
    }
    /// Row-major V: offset in VALUES of (cell 32*tile + j, dimension d) from the start of a
    /// tile: blocks of v_block dimensions, each [32 cells][v_block] (the last block
    /// narrower when v_block does not divide dim_v). In units: v_in_tile(j, d) / block().
    [[nodiscard]] std::size_t v_in_tile(std::uint32_t j, std::uint32_t d) const noexcept {
        const std::uint32_t d0 = d / v_block * v_block;
        const std::uint32_t w = dim_v - d0 < v_block ? dim_v - d0 : v_block;
        return std::size_t{d0} * k_tile + std::size_t{j} * w + (d - d0);
    }
    /// Offset of the V unit holding element (h, cell, d) for either V layout (the element
    /// itself when block() == 1).
    [[nodiscard]] std::size_t v_offset(std::uint32_t h, std::uint32_t c, std::uint32_t d) const noexcept {
        return vl == v_layout::row_major ? h * v_head_stride + std::size_t{c / k_tile} * k_tile * v_units() +
                                               (v_in_tile(c % k_tile, d) >> block_log2)
                                         : h * v_head_stride + std::size_t{d >> block_log2} * n_cells_pad + c;
    }
    /// Offset of V unit u of (h, cell): dimensions [u*block(), (u+1)*block()) (u < v_units()).
    [[nodiscard]] std::size_t v_unit(std::uint32_t h, std::uint32_t c, std::uint32_t u) const noexcept {
        return v_offset(h, c, u << block_log2);
    }
};

KVCACHE_END_NAMESPACE
