// Test helper shared by the K-shift tests: fills sequence 0 of a cache with keys whose
// float64 origin is known, so a test can compare shifted K with a direct RoPE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include <kvcache/tokens/token.hpp>

#include "reference/rope_ref.hpp"

namespace kvtest {

/// Places `pos` in sequence 0 and commits: K = rope(x, p) scaled by (1 + 0.1 * layer),
/// V = 0.5, x ~ N(0, 1) per (token, KV head). Returns the x rows, token-major then head.
template <class Cache>
std::vector<std::vector<double>> fill_rope(Cache& cache, const std::vector<kvcache::pos_t>& pos, std::mt19937& rng) {
    const auto& s = cache.shape();
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<std::vector<double>> x(pos.size() * s.n_head_kv, std::vector<double>(s.dim_k()));
    for (auto& row : x)
        for (auto& v : row) v = nd(rng);
    std::vector<kvcache::seq_id_t> seq(pos.size(), 0);
    auto pl = cache.place(pos, seq).value();
    for (std::uint32_t l = 0; l < s.n_layer; ++l) {
        std::vector<float> k(pos.size() * s.k_row_size()), v(pos.size() * s.v_row_size(), 0.5f);
        for (std::size_t i = 0; i < pos.size(); ++i)
            for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                const auto r = ref::rope_head(x[i * s.n_head_kv + h], pos[i], s.rope);
                for (std::uint32_t d = 0; d < s.dim_k(); ++d)
                    k[i * s.k_row_size() + h * s.dim_k() + d] = static_cast<float>(r[d] * (1.0 + 0.1 * l));
            }
        cache.write_k(l, pl.cells, k.data());
        cache.write_v(l, pl.cells, v.data());
    }
    static_cast<void>(cache.commit());
    return x;
}

}  // namespace kvtest
