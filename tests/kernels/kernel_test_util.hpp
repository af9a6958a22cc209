// Helpers the kernel tests share (the folder is compiled as one translation unit, so each
// helper exists once): error measures against the float64 references, the cache types a
// templated test case runs over, a cache's raw K or V bytes, and filling its free cells.
#pragma once

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvtest {

/// NMSE tolerance of quantized attention's SIMD path against the stored (dequantized) values:
/// q8_0's q.K runs on a 16-bit query (typical 4e-10); q4_0's on an 8-bit one as llama.cpp's
/// q4_0 dot products do (typical 3e-5) and, on AVX2, its p.V on 8-bit weights (rounded per
/// tile, unit and query head: 1.5e-5 - 2.2e-4 seen); both far below the 4-bit K/V rounding
/// (1.3e-2; tests/element/test_quant.cpp).
template <class E>
constexpr double quant_simd_tol = std::is_same_v<E, kvcache::q4_0> ? 5e-4 : 3e-9;

/// Normalised mean squared error: sum (got - want)^2 / sum want^2 (plain sum when want is 0).
inline double nmse(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
        const double d = got[i] - want[i];
        num += d * d;
        den += want[i] * want[i];
    }
    return den > 0.0 ? num / den : num;
}

/// Relative L1 error: sum |got - want| / sum |want|.
inline double rel_l1(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
        num += std::abs(got[i] - want[i]);
        den += std::abs(want[i]);
    }
    return num / den;
}

/// Cells per block of a layout (1 where cells are not grouped in blocks).
template <class Layout>
inline constexpr std::uint32_t block_cells = 1;
template <std::uint32_t B, kvcache::v_layout V>
inline constexpr std::uint32_t block_cells<kvcache::paged<B, V>> = B;

/// A cache type for TEST_CASE_TEMPLATE, with the NMSE an f32-computed output reaches
/// against the float64 reference for its element type.
template <class Element, class Layout>
struct layout_combo {
    using cache = kvcache::kv_cache<Element, Layout>;
    static constexpr double tol_f32 = std::is_same_v<Element, kvcache::f32>   ? 1e-10
                                      : std::is_same_v<Element, kvcache::f16> ? 5e-4
                                                                              : 5e-3;
};

/// Every cell's K (v_side false) or V bytes, layer by layer, in cell order.
template <class Cache>
std::vector<typename Cache::storage_type> all_bytes(const Cache& cache, bool v_side) {
    std::vector<typename Cache::storage_type> out, one;
    for (std::uint32_t l = 0; l < cache.shape().n_layer; ++l)
        for (std::uint32_t c = 0; c < cache.storage().n_cells_padded() && c < cache.capacity(); ++c) {
            cache.storage().cell_bytes(l, c, v_side, one);
            out.insert(out.end(), one.begin(), one.end());
        }
    return out;
}

/// Sets every K and V value of every free cell (and of the padding cells past the
/// capacity) to `value`, in every layer: a kernel that reads a free cell then poisons its
/// output (NaN) or moves it far off (a large value).
template <class Cache>
void fill_free_cells(Cache& cache, float value) {
    const auto& s = cache.shape();
    typename Cache::storage_type bad;
    Cache::element::from_float(&value, &bad, 1);
    for (std::uint32_t l = 0; l < s.n_layer; ++l) {
        auto v = cache.storage().view(l);
        for (std::uint32_t cell = 0; cell < v.n_cells_pad; ++cell) {
            if (cell < cache.capacity() && !cache.cells().is_free(cell)) continue;
            for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                for (std::uint32_t d = 0; d < s.dim_k(); ++d) v.k[v.k_offset(h, cell, d)] = bad;
                for (std::uint32_t d = 0; d < s.dim_v(); ++d) v.v[v.v_offset(h, cell, d)] = bad;
            }
        }
    }
}

}  // namespace kvtest
