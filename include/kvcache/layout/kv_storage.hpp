// kvcache: tiled_kv_storage, the K/V buffers of the cell-indexed layouts, in the format
// described in format/kv_view.hpp (tiles of 32 cells, RoPE pair order, V blocks).
#pragma once

#include <algorithm>  // std::min, std::max
#include <cstddef>    // std::size_t
#include <cstdint>    // std::uint32_t
#include <cstring>    // std::memset
#include <memory>     // std::unique_ptr
#include <new>        // aligned operator new
#include <string>     // messages
#include <vector>     // conversion scratch

#if defined(__linux__)
#include <sys/mman.h>  // madvise (huge pages for the K/V buffers)
#endif

#include "../concepts.hpp"
#include "../element/contract.hpp"
#include "../error.hpp"
#include "../format/kv_view.hpp"
#include "../model_shape.hpp"
#include "capabilities.hpp"

KVCACHE_BEGIN_NAMESPACE

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

/// K/V buffers for all layers, arranged as described at the top of this file.
/// Allocated once at construction, zero-initialised (F2), never reallocated.
/// Block elements (block_size 32, e.g. q8_0): one storage unit per 32 values of one cell
/// (format/kv_view.hpp, "Block elements"); the constructor throws
/// kvcache::error(invalid_config) unless head_dim_k and head_dim_v are multiples of 32.
template <class Element, v_layout VLayout>
class tiled_kv_storage {
public:
    using element = Element;
    using storage_type = typename Element::storage_type;
    static constexpr v_layout v_arrangement = VLayout;
    /// No optional hooks (layout/capabilities.hpp); a derived layout storage declares its own.
    static constexpr layout_caps capabilities = layout_caps::none;

    explicit tiled_kv_storage(const model_shape& s)
        : n_layer_(checked_block_dims(s).n_layer),
          n_head_kv_(s.n_head_kv),
          dim_k_(s.dim_k()),
          dim_v_(s.dim_v()),
          neox_rot_(s.rope.type == rope_type::neox ? s.n_rot() : 0),
          n_cells_pad_((s.n_cells + k_tile - 1) / k_tile * k_tile),
          k_head_stride_(std::size_t{n_cells_pad_} * (dim_k_ >> lg)),
          v_head_stride_(std::size_t{n_cells_pad_} * (dim_v_ >> lg)),
          k_layer_stride_(k_head_stride_ * n_head_kv_),
          v_layer_stride_(v_head_stride_ * n_head_kv_),
          k_(detail::make_zeroed<storage_type>(k_layer_stride_ * n_layer_)),
          v_(detail::make_zeroed<storage_type>(v_layer_stride_ * n_layer_)),
          scratch_(is_block_element<Element> ? 0 : std::max(dim_k_, dim_v_)),
          fscratch_(is_block_element<Element> ? dim_k_ : 0) {}

    /// Bytes reserved for K and V of all layers.
    [[nodiscard]] std::size_t bytes() const noexcept {
        return (k_layer_stride_ + v_layer_stride_) * n_layer_ * sizeof(storage_type);
    }
    [[nodiscard]] std::uint32_t n_cells_padded() const noexcept { return n_cells_pad_; }

    [[nodiscard]] kv_layer_view<storage_type> view(std::uint32_t layer) noexcept {
        return {k_.get() + layer * k_layer_stride_, v_.get() + layer * v_layer_stride_, n_head_kv_, dim_k_, dim_v_,
                n_cells_pad_, k_head_stride_, v_head_stride_, VLayout, neox_rot_, lg};
    }
    [[nodiscard]] kv_layer_view<const storage_type> view(std::uint32_t layer) const noexcept {
        return {k_.get() + layer * k_layer_stride_, v_.get() + layer * v_layer_stride_, n_head_kv_, dim_k_, dim_v_,
                n_cells_pad_, k_head_stride_, v_head_stride_, VLayout, neox_rot_, lg};
    }

    /// Writes one cell's K row (n_head_kv x dim_k floats, head-major) into layer `layer`.
    void write_k(std::uint32_t layer, std::uint32_t cell, const float* row) {
        const auto v = view(layer);
        if constexpr (is_block_element<Element>) {  // rows in pair order, quantized 32 at a time
            for (std::uint32_t h = 0; h < n_head_kv_; ++h) {
                for (std::uint32_t d = 0; d < dim_k_; ++d) fscratch_[v.k_row(d)] = row[std::size_t{h} * dim_k_ + d];
                for (std::uint32_t u = 0; u < v.k_units(); ++u)
                    Element::from_float(fscratch_.data() + std::size_t{u} * block, v.k + v.k_unit(h, cell, u), block);
            }
            return;
        }
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
            } else if constexpr (is_block_element<Element>) {
                for (std::uint32_t u = 0; u < v.v_units(); ++u)
                    Element::from_float(row + std::size_t{h} * dim_v_ + std::size_t{u} * block, v.v + v.v_unit(h, cell, u),
                                        block);
            } else {
                Element::from_float(row + std::size_t{h} * dim_v_, scratch_.data(), dim_v_);
                for (std::uint32_t d = 0; d < dim_v_; ++d) v.v[v.v_offset(h, cell, d)] = scratch_[d];
            }
        }
    }
    /// Reads one cell's K row back as floats.
    void read_k(std::uint32_t layer, std::uint32_t cell, float* row) const {
        const auto v = view(layer);
        if constexpr (is_block_element<Element>) {
            float tmp[block];
            for (std::uint32_t h = 0; h < n_head_kv_; ++h)
                for (std::uint32_t d = 0; d < dim_k_; ++d) {
                    Element::to_float(v.k + v.k_offset(h, cell, d), tmp, block);
                    row[std::size_t{h} * dim_k_ + d] = tmp[v.k_row(d) % block];
                }
            return;
        }
        for (std::uint32_t h = 0; h < n_head_kv_; ++h)
            for (std::uint32_t d = 0; d < dim_k_; ++d)
                Element::to_float(v.k + v.k_offset(h, cell, d), row + std::size_t{h} * dim_k_ + d, 1);
    }
    /// Reads one cell's V row back as floats.
    void read_v(std::uint32_t layer, std::uint32_t cell, float* row) const {
        const auto v = view(layer);
        if constexpr (is_block_element<Element>) {
            for (std::uint32_t h = 0; h < n_head_kv_; ++h)
                for (std::uint32_t u = 0; u < v.v_units(); ++u)
                    Element::to_float(v.v + v.v_unit(h, cell, u), row + std::size_t{h} * dim_v_ + std::size_t{u} * block,
                                      block);
            return;
        }
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
                for (std::uint32_t u = 0; u < v.k_units(); ++u) v.k[v.k_unit(h, dst, u)] = v.k[v.k_unit(h, src, u)];
                for (std::uint32_t u = 0; u < v.v_units(); ++u) v.v[v.v_unit(h, dst, u)] = v.v[v.v_unit(h, src, u)];
            }
        }
    }
    /// Raw bytes of one cell's K (or V) in one layer, in (head, d) order, for comparisons
    /// (block elements: in (head, unit) order, units in row order).
    void cell_bytes(std::uint32_t layer, std::uint32_t cell, bool is_v, std::vector<storage_type>& out) const {
        const auto v = view(layer);
        if constexpr (is_block_element<Element>) {
            const std::uint32_t units = is_v ? v.v_units() : v.k_units();
            out.resize(std::size_t{n_head_kv_} * units);
            for (std::uint32_t h = 0; h < n_head_kv_; ++h)
                for (std::uint32_t u = 0; u < units; ++u)
                    out[std::size_t{h} * units + u] = is_v ? v.v[v.v_unit(h, cell, u)] : v.k[v.k_unit(h, cell, u)];
            return;
        }
        const std::uint32_t dim = is_v ? dim_v_ : dim_k_;
        out.resize(std::size_t{n_head_kv_} * dim);
        for (std::uint32_t h = 0; h < n_head_kv_; ++h)
            for (std::uint32_t d = 0; d < dim; ++d)
                out[std::size_t{h} * dim + d] = is_v ? v.v[v.v_offset(h, cell, d)] : v.k[v.k_offset(h, cell, d)];
    }

private:
    static constexpr std::uint32_t lg = block_log2<Element>;  // kv_layer_view::block_log2
    static constexpr std::uint32_t block = element_block_size_v<Element>;
    static const model_shape& checked_block_dims(const model_shape& s) {
        if constexpr (is_block_element<Element>) {
            auto bad = [](const char* name, std::uint32_t value) {
                detail::fail(errc::invalid_config, std::string("model_shape.") + name + " = " + std::to_string(value) +
                                                       ": element " + std::string(Element::name) +
                                                       " stores blocks of 32 values, needs a multiple of 32");
            };
            if (s.dim_k() % block != 0) bad("head_dim_k", s.dim_k());
            if (s.dim_v() % block != 0) bad("head_dim_v", s.dim_v());
        }
        return s;
    }
    std::uint32_t n_layer_, n_head_kv_, dim_k_, dim_v_;
    std::uint32_t neox_rot_;     // kv_layer_view::neox_rot
    std::uint32_t n_cells_pad_;  // cells allocated: n_cells rounded up to k_tile
    std::size_t k_head_stride_, v_head_stride_, k_layer_stride_, v_layer_stride_;
    std::unique_ptr<storage_type[], detail::aligned_delete> k_;  // invariant: never reallocated
    std::unique_ptr<storage_type[], detail::aligned_delete> v_;
    std::vector<storage_type> scratch_;  // one head row, for strided writes
    std::vector<float> fscratch_;        // block elements: one head's K row in pair order
};

KVCACHE_END_NAMESPACE
