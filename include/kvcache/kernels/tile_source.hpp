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
    static_assert(element_block_size_v<Element> == 1,
                  "kvcache: block elements (element block_size > 1) are not supported by the tiled layouts yet");
    using T = typename Element::storage_type;
    using value_type = float;
    float* k_buf = nullptr;  ///< k_tile x dim_k floats
    float* v_buf = nullptr;  ///< k_tile x dim_v floats

    [[nodiscard]] const float* k_rows(const kv_layer_view<const T>& kv, std::uint32_t h,
                                      std::uint32_t tile) const noexcept {
        Element::to_float(kv.k_tile_ptr(h, tile), k_buf, std::size_t{k_tile} * kv.dim_k);
        return k_buf;
    }
    [[nodiscard]] const float* v_rows(const kv_layer_view<const T>& kv, std::uint32_t h,
                                      std::uint32_t tile) const noexcept {
        Element::to_float(kv.v_tile_ptr(h, tile), v_buf, std::size_t{k_tile} * kv.dim_v);
        return v_buf;
    }
    void v_column(const T* src, std::size_t stride, float* dst, std::size_t n) const noexcept {
        for (std::size_t i = 0; i < n; ++i) Element::to_float(src + i * stride, dst + i, 1);
    }
};

}  // namespace kernels
KVCACHE_END_NAMESPACE
