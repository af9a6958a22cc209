// kvcache: the K/V buffer arrangement shared by the cell-indexed layouts.
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
#pragma once

#include <algorithm>  // std::fill_n
#include <cstddef>    // std::size_t
#include <cstdint>    // std::uint32_t
#include <cstring>    // std::memset, std::memcpy
#include <memory>     // std::unique_ptr
#include <new>        // aligned operator new
#include <vector>     // conversion scratch

#if defined(__linux__)
#include <sys/mman.h>  // madvise (huge pages for the K/V buffers)
#endif

#include "../concepts.hpp"
#include "../model_shape.hpp"

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

    /// Row of dimension d inside a K tile (see "RoPE pair order" above).
    [[nodiscard]] std::uint32_t k_row(std::uint32_t d) const noexcept {
        const std::uint32_t half = neox_rot / 2;
        if (d >= neox_rot) return d;
        return d < half ? 2 * d : 2 * (d - half) + 1;
    }
    /// First element of K tile `tile` (cells [32*tile, 32*tile + 32)) of head h: dim_k rows of 32.
    [[nodiscard]] T* k_tile_ptr(std::uint32_t h, std::uint32_t tile) const noexcept {
        return k + h * k_head_stride + std::size_t{tile} * k_tile * dim_k;
    }
    /// Offset of K element (h, cell, dimension d).
    [[nodiscard]] std::size_t k_offset(std::uint32_t h, std::uint32_t c, std::uint32_t d) const noexcept {
        return h * k_head_stride + std::size_t{c / k_tile} * k_tile * dim_k + std::size_t{k_row(d)} * k_tile + c % k_tile;
    }
    /// Row-major V: first element of tile `tile` (cells [32*tile, 32*tile + 32)) of head h.
    [[nodiscard]] T* v_tile_ptr(std::uint32_t h, std::uint32_t tile) const noexcept {
        return v + h * v_head_stride + std::size_t{tile} * k_tile * dim_v;
    }
    /// Row-major V: offset of (cell 32*tile + j, dimension d) from v_tile_ptr: blocks of
    /// v_block dimensions, each [32 cells][v_block] (the last block narrower when
    /// v_block does not divide dim_v).
    [[nodiscard]] std::size_t v_in_tile(std::uint32_t j, std::uint32_t d) const noexcept {
        const std::uint32_t d0 = d / v_block * v_block;
        const std::uint32_t w = dim_v - d0 < v_block ? dim_v - d0 : v_block;
        return std::size_t{d0} * k_tile + std::size_t{j} * w + (d - d0);
    }
    /// Offset of V element (h, cell, d) for either V layout.
    [[nodiscard]] std::size_t v_offset(std::uint32_t h, std::uint32_t c, std::uint32_t d) const noexcept {
        return vl == v_layout::row_major
                   ? h * v_head_stride + std::size_t{c / k_tile} * k_tile * dim_v + v_in_tile(c % k_tile, d)
                   : h * v_head_stride + std::size_t{d} * n_cells_pad + c;
    }
};

/// K/V buffers of at least this many bytes start on a 2 MiB boundary and, on Linux, are
/// advised MADV_HUGEPAGE before they are first touched, so that with transparent huge
/// pages in "madvise" or "always" mode the kernels stream them with one TLB entry per
/// 2 MiB instead of per 4 KiB. Where a TLB miss is dear (virtual machines: a two-level
/// page walk) this made cold 16K decode on 2 threads ~15% faster in the median of 10
/// alternating runs on the 2-core Zen 5 VM (bench/README.md). It is advice only: with
/// THP off ("never") nothing changes. Define KVCACHE_NO_HUGE_PAGES to skip the advice.
inline constexpr std::size_t huge_page_bytes = std::size_t{1} << 21;

namespace detail {
struct aligned_delete {
    std::size_t align = 64;  // the alignment the buffer was allocated with
    void operator()(void* p) const noexcept { ::operator delete[](p, std::align_val_t{align}); }
};

/// Advises the kernel to back [p, p + bytes) with huge pages (p 2 MiB aligned; whole
/// huge pages only). Returns whether the advice was given and accepted.
inline bool advise_huge_pages(void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE) && !defined(KVCACHE_NO_HUGE_PAGES)
    const std::size_t whole = bytes / huge_page_bytes * huge_page_bytes;
    return whole > 0 && ::madvise(p, whole, MADV_HUGEPAGE) == 0;
#else
    static_cast<void>(p);
    static_cast<void>(bytes);
    return false;
#endif
}

/// Zero-initialised buffer of n trivially copyable T: 64-byte aligned, or 2 MiB aligned
/// and advised huge pages from huge_page_bytes up (see above).
template <class T>
std::unique_ptr<T[], aligned_delete> make_zeroed(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    const std::size_t align = bytes >= huge_page_bytes ? huge_page_bytes : 64;
    void* p = ::operator new[](bytes, std::align_val_t{align});
    if (align == huge_page_bytes) static_cast<void>(advise_huge_pages(p, bytes));
    std::memset(p, 0, bytes);  // first touch: faults in huge pages where the advice took
    return std::unique_ptr<T[], aligned_delete>(static_cast<T*>(p), aligned_delete{align});
}
}  // namespace detail

namespace detail {
/// Lowest sequence id in a non-empty set (the sequence whose region or block hint a
/// shared token uses).
template <class SeqSet>
[[nodiscard]] seq_id_t lowest_seq(const SeqSet& set) noexcept {
    seq_id_t s0 = -1;
    set.for_each([&](seq_id_t s) {
        if (s0 < 0) s0 = s;
    });
    return s0;
}
}  // namespace detail

/// Copy-on-write step of a placement: sequence `seq` leaves shared cell `src` for its
/// own copy `dst` (K/V of every layer copied, same position and pending shift).
struct cell_copy {
    std::uint32_t src = 0;
    std::uint32_t dst = 0;
    seq_id_t seq = 0;
};

/// A layout's answer to "where does this micro-batch go" (optional storage hook
/// `plan_place`; layouts without it use the cache's head-based slot search, F3).
/// copies are applied first, then token i goes to cells[i].
struct placement_plan {
    std::vector<std::uint32_t> cells;
    std::vector<cell_copy> copies;
};

/// K/V buffers for all layers, arranged as described at the top of this file.
/// Allocated once at construction, zero-initialised (F2), never reallocated.
template <class Element, v_layout VLayout>
class tiled_kv_storage {
public:
    using element = Element;
    using storage_type = typename Element::storage_type;
    static constexpr v_layout v_arrangement = VLayout;

    explicit tiled_kv_storage(const model_shape& s)
        : n_layer_(s.n_layer),
          n_head_kv_(s.n_head_kv),
          dim_k_(s.dim_k()),
          dim_v_(s.dim_v()),
          neox_rot_(s.rope.type == rope_type::neox ? s.n_rot() : 0),
          n_cells_pad_((s.n_cells + k_tile - 1) / k_tile * k_tile),
          k_head_stride_(std::size_t{n_cells_pad_} * dim_k_),
          v_head_stride_(std::size_t{n_cells_pad_} * dim_v_),
          k_layer_stride_(k_head_stride_ * n_head_kv_),
          v_layer_stride_(v_head_stride_ * n_head_kv_),
          k_(detail::make_zeroed<storage_type>(k_layer_stride_ * n_layer_)),
          v_(detail::make_zeroed<storage_type>(v_layer_stride_ * n_layer_)),
          scratch_(std::max(dim_k_, dim_v_)) {}

    /// Bytes reserved for K and V of all layers.
    [[nodiscard]] std::size_t bytes() const noexcept {
        return (k_layer_stride_ + v_layer_stride_) * n_layer_ * sizeof(storage_type);
    }
    [[nodiscard]] std::uint32_t n_cells_padded() const noexcept { return n_cells_pad_; }

    [[nodiscard]] kv_layer_view<storage_type> view(std::uint32_t layer) noexcept {
        return {k_.get() + layer * k_layer_stride_, v_.get() + layer * v_layer_stride_, n_head_kv_, dim_k_, dim_v_,
                n_cells_pad_, k_head_stride_, v_head_stride_, VLayout, neox_rot_};
    }
    [[nodiscard]] kv_layer_view<const storage_type> view(std::uint32_t layer) const noexcept {
        return {k_.get() + layer * k_layer_stride_, v_.get() + layer * v_layer_stride_, n_head_kv_, dim_k_, dim_v_,
                n_cells_pad_, k_head_stride_, v_head_stride_, VLayout, neox_rot_};
    }

    /// Writes one cell's K row (n_head_kv x dim_k floats, head-major) into layer `layer`.
    void write_k(std::uint32_t layer, std::uint32_t cell, const float* row) {
        const auto v = view(layer);
        for (std::uint32_t h = 0; h < n_head_kv_; ++h) {
            Element::from_float(row + std::size_t{h} * dim_k_, scratch_.data(), dim_k_);
            for (std::uint32_t d = 0; d < dim_k_; ++d) v.k[v.k_offset(h, cell, d)] = scratch_[d];
        }
    }
    /// Writes one cell's V row (n_head_kv x dim_v floats, head-major) into layer `layer`.
    void write_v(std::uint32_t layer, std::uint32_t cell, const float* row) {
        const auto v = view(layer);
        for (std::uint32_t h = 0; h < n_head_kv_; ++h) {
            if constexpr (VLayout == v_layout::row_major) {
                for (std::uint32_t d0 = 0; d0 < dim_v_; d0 += v_block)  // one piece per V block
                    Element::from_float(row + std::size_t{h} * dim_v_ + d0, v.v + v.v_offset(h, cell, d0),
                                        std::min(v_block, dim_v_ - d0));
            } else {
                Element::from_float(row + std::size_t{h} * dim_v_, scratch_.data(), dim_v_);
                for (std::uint32_t d = 0; d < dim_v_; ++d) v.v[v.v_offset(h, cell, d)] = scratch_[d];
            }
        }
    }
    /// Reads one cell's K row back as floats.
    void read_k(std::uint32_t layer, std::uint32_t cell, float* row) const {
        const auto v = view(layer);
        for (std::uint32_t h = 0; h < n_head_kv_; ++h)
            for (std::uint32_t d = 0; d < dim_k_; ++d)
                Element::to_float(v.k + v.k_offset(h, cell, d), row + std::size_t{h} * dim_k_ + d, 1);
    }
    /// Reads one cell's V row back as floats.
    void read_v(std::uint32_t layer, std::uint32_t cell, float* row) const {
        const auto v = view(layer);
        for (std::uint32_t h = 0; h < n_head_kv_; ++h)
            for (std::uint32_t d = 0; d < dim_v_; ++d)
                Element::to_float(v.v + v.v_offset(h, cell, d), row + std::size_t{h} * dim_v_ + d, 1);
    }
    /// Copies K and V of every layer from cell src to cell dst (bit-exact).
    void copy_cell(std::uint32_t src, std::uint32_t dst) noexcept {
        if (src == dst) return;
        for (std::uint32_t l = 0; l < n_layer_; ++l) {
            const auto v = view(l);
            for (std::uint32_t h = 0; h < n_head_kv_; ++h) {
                for (std::uint32_t d = 0; d < dim_k_; ++d) v.k[v.k_offset(h, dst, d)] = v.k[v.k_offset(h, src, d)];
                for (std::uint32_t d = 0; d < dim_v_; ++d) v.v[v.v_offset(h, dst, d)] = v.v[v.v_offset(h, src, d)];
            }
        }
    }
    /// Raw bytes of one cell's K (or V) in one layer, in (head, d) order, for comparisons.
    void cell_bytes(std::uint32_t layer, std::uint32_t cell, bool is_v, std::vector<storage_type>& out) const {
        const auto v = view(layer);
        const std::uint32_t dim = is_v ? dim_v_ : dim_k_;
        out.resize(std::size_t{n_head_kv_} * dim);
        for (std::uint32_t h = 0; h < n_head_kv_; ++h)
            for (std::uint32_t d = 0; d < dim; ++d)
                out[std::size_t{h} * dim + d] = is_v ? v.v[v.v_offset(h, cell, d)] : v.k[v.k_offset(h, cell, d)];
    }

private:
    std::uint32_t n_layer_, n_head_kv_, dim_k_, dim_v_;
    std::uint32_t neox_rot_;     // kv_layer_view::neox_rot
    std::uint32_t n_cells_pad_;  // cells allocated: n_cells rounded up to k_tile
    std::size_t k_head_stride_, v_head_stride_, k_layer_stride_, v_layer_stride_;
    std::unique_ptr<storage_type[], detail::aligned_delete> k_;  // invariant: never reallocated
    std::unique_ptr<storage_type[], detail::aligned_delete> v_;
    std::vector<storage_type> scratch_;  // one head row, for strided writes
};

KVCACHE_END_NAMESPACE
