// kvcache kernels: where the attention kernel reads a tile's K and V from.
//
// The storage types simd/tile_io.hpp loads with SIMD (f32, f16, bf16) are read in
// place: the kernel converts while it loads. For any other element (concepts.hpp,
// "Element policy") the kernel is given a converted_tiles<Element>: each visited tile's
// K rows and V rows are converted with Element::to_float into two f32 scratch buffers of
// the work item (k_tile x dim_k and k_tile x dim_v floats, caller-owned: nothing is
// allocated), and the kernel then runs its f32 code on them. ops choose at compile time
// (detail::has_simd_storage, element/contract.hpp), so the built-in elements keep their
// machine code and a custom element is correct everywhere, only slower.
//
// Block elements (block_size 32: q8_0, q4_0; format/kv_view.hpp, "Block elements"): a K
// tile's units are [row block][32 cells], each unit 32 rows of one cell, so k_rows
// dequantizes each unit and transposes it into the [row][32 cells] f32 rows the kernel
// expects. A row-major V tile's units are already in the f32 order (each cell's piece
// of a V block is consecutive units), and a transposed V column is one unit per 32
// dimensions, cp units apart. For q8_0 / q4_0 the ops pass quant_tiles (quant_decode.hpp),
// which keeps these conversions but whose own stages read the blocks in place.
#pragma once

#include <cstddef>  // std::size_t
#include <cstdint>  // std::uint32_t

#include "../concepts.hpp"
#include "../config.hpp"
#include "../format/kv_view.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// Tiles converted through Element::to_float into f32 scratch (the generic path).
template <class Element>
struct converted_tiles {
    static constexpr std::uint32_t block = element_block_size_v<Element>;
    static_assert(block == 1 || block == k_tile, "kvcache: the tiled layouts store block_size 1 or 32");
    using T = typename Element::storage_type;
    using value_type = float;
    float* k_buf = nullptr;  ///< k_tile x dim_k floats
    float* v_buf = nullptr;  ///< k_tile x dim_v floats

    [[nodiscard]] const float* k_rows(const kv_layer_view<const T>& kv, std::uint32_t h,
                                      std::uint32_t tile) const noexcept {
        if constexpr (block == 1) {
            Element::to_float(kv.k_tile_ptr(h, tile), k_buf, std::size_t{k_tile} * kv.dim_k);
        } else {
            const T* t = kv.k_tile_ptr(h, tile);
            alignas(64) float unit[block];
            for (std::uint32_t u = 0; u < kv.k_units(); ++u) {
                float* rows = k_buf + std::size_t{u} * block * k_tile;  // rows [32u, 32u + 32)
                for (std::uint32_t j = 0; j < k_tile; ++j) {
                    Element::to_float(t + std::size_t{u} * k_tile + j, unit, block);
                    for (std::uint32_t i = 0; i < block; ++i) rows[std::size_t{i} * k_tile + j] = unit[i];
                }
            }
        }
        return k_buf;
    }
    [[nodiscard]] const float* v_rows(const kv_layer_view<const T>& kv, std::uint32_t h,
                                      std::uint32_t tile) const noexcept {
        Element::to_float(kv.v_tile_ptr(h, tile), v_buf, std::size_t{k_tile} * kv.dim_v);
        return v_buf;
    }
    /// One cell's transposed V row: n values whose units are `stride` units apart.
    void v_column(const T* src, std::size_t stride, float* dst, std::size_t n) const noexcept {
        for (std::size_t i = 0; i < n / block; ++i) Element::to_float(src + i * stride, dst + i * block, block);
    }
};

}  // namespace kernels
KVCACHE_END_NAMESPACE
