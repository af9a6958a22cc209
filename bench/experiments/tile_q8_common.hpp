// What the tile-format experiments (tile_q8_decode.cpp, tile_q8_kshift.cpp) share: the
// shape of bench_kernels.cpp's rows, the K tile layout, one q8_0 block quantized by the
// library's own q8_0::from_float, and library caches filled like bench_kernels.cpp's.
#pragma once

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

namespace tile_exp {

using kvcache::pos_t;
using kvcache::seq_id_t;
constexpr int D = 128, HKV = 8;  // head dim, KV heads

inline std::uint16_t f2h(float x) { return static_cast<std::uint16_t>(kvcache::scalar::f32_to_f16(x)); }
inline float h2f(std::uint16_t b) { return kvcache::scalar::f16_to_f32(static_cast<kvcache::half>(b)); }

/// One KV head's K for 32 cells: binary16 scales per unit of 32 rows, then the codes + 128 as
/// [group of 4 rows][cell][4 rows] (one vpdpbusd: 4 rows x 16 cells).
struct alignas(64) ktile {
    std::uint16_t d[4][32];
    std::uint8_t c[32][32][4];
};

/// 32 values as one q8_0 block (kvcache::q8_0::from_float): codes q, scale bits dbits.
inline void quant_block(const float* x, std::int8_t* q, std::uint16_t& dbits) {
    kvcache::block_q8_0 b;
    kvcache::q8_0::from_float(x, &b, 32);
    dbits = static_cast<std::uint16_t>(b.d);
    std::memcpy(q, b.qs, 32);
}

/// bench_kernels.cpp's data: 65,536 N(0, 0.5) values, repeated over every cell.
inline std::vector<float> random_pattern() {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    std::vector<float> pf(65536);
    for (auto& x : pf) x = nd(rng);
    return pf;
}

/// A library cache of n cells (sequence 0 at positions 0..n-1), n_layer layers, K and V
/// filled with pf (as bench_kernels.cpp's make_cache).
template <class E>
std::unique_ptr<kvcache::kv_cache<E>> make_cache(int n, int n_layer, const std::vector<float>& pf) {
    kvcache::model_shape s;
    s.n_layer = static_cast<std::uint32_t>(n_layer);
    s.n_head_kv = HKV;
    s.head_dim_k = D;
    s.n_cells = static_cast<std::uint32_t>(n);
    s.n_seq_max = 1;
    auto cache = std::make_unique<kvcache::kv_cache<E>>(s);
    std::vector<pos_t> pos(static_cast<std::size_t>(n));
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<seq_id_t> seq(static_cast<std::size_t>(n), 0);
    static_cast<void>(cache->place(pos, seq).value());
    static_cast<void>(cache->commit());
    using T = typename E::storage_type;
    constexpr std::size_t B = kvcache::element_block_size_v<E>;
    std::vector<T> pattern(pf.size() / B);
    E::from_float(pf.data(), pattern.data(), pf.size());
    const std::size_t elems = std::size_t{cache->storage().n_cells_padded()} * D * HKV / B;
    for (int l = 0; l < n_layer; ++l) {
        auto v = cache->storage().view(static_cast<std::uint32_t>(l));
        for (T* base : {v.k, v.v})
            for (std::size_t off = 0; off < elems; off += pattern.size())
                std::memcpy(base + off, pattern.data(), std::min(pattern.size(), elems - off) * sizeof(T));
    }
    return cache;
}

inline double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace tile_exp
