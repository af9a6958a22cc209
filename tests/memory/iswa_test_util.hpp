// Shared helpers of the ISWA tests (tests/memory, tests/io, tests/ops): a small
// iswa_cache filled through the public API with random K/V, and a bit-exact picture of
// both parts (metadata, indexes, raw K/V bytes, ring pruning points).
#pragma once

#include <kvcache/kvcache.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "support/cache_snapshot.hpp"

namespace kvtest {

inline constexpr std::uint32_t iswa_w = 16;
using iswa16 = kvcache::iswa_cache<iswa_w, kvcache::f32>;

/// 4 layers (1 and 3 full attention), 2 KV heads of 8, n_seq sequences, full capacity n_cells.
template <std::uint32_t W = iswa_w>
kvcache::iswa_shape iswa_test_shape(std::uint32_t n_seq = 2, std::uint32_t n_cells = 128, std::uint32_t period = 2) {
    kvcache::iswa_shape s;
    s.shape.n_layer = 4;
    s.shape.n_head_kv = 2;
    s.shape.head_dim_k = 8;
    s.shape.n_cells = n_cells;
    s.shape.n_seq_max = n_seq;
    s.swa_layers = kvcache::iswa_shape::every_nth_full(4, period);
    s.swa_n_cells = kvcache::ring<W>::cells_for(n_seq, 8);
    return s;
}

/// Places positions [p0, p0 + n) of sequence s in batches of at most 8, writes random K/V
/// into every layer and commits each batch.
template <class Iswa>
void iswa_fill(Iswa& c, kvcache::seq_id_t s, kvcache::pos_t p0, std::uint32_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const auto& sh = c.full().shape();
    for (std::uint32_t done = 0; done < n;) {
        const std::uint32_t b = std::min<std::uint32_t>(8, n - done);
        std::vector<kvcache::pos_t> pos(b);
        std::vector<kvcache::seq_id_t> seq(b, s);
        for (std::uint32_t i = 0; i < b; ++i) pos[i] = p0 + static_cast<kvcache::pos_t>(done + i);
        auto r = c.place(pos, seq);
        if (!r) throw kvcache::error(r.code(), r.message());
        for (std::uint32_t l = 0; l < c.n_layer(); ++l) {
            std::vector<float> k(b * sh.k_row_size()), v(b * sh.v_row_size());
            for (auto& x : k) x = u(rng);
            for (auto& x : v) x = u(rng);
            c.write_k(l, r.value(), k.data());
            c.write_v(l, r.value(), v.data());
        }
        static_cast<void>(c.commit());
        done += b;
    }
}

/// Both parts of an ISWA cache, bit for bit, with the ring's pruning points.
struct iswa_snapshot {
    cache_snapshot full, swa;
    std::vector<kvcache::pos_t> pruned;
    friend bool operator==(const iswa_snapshot&, const iswa_snapshot&) = default;
};

template <class Iswa>
iswa_snapshot iswa_snap(const Iswa& c) {
    iswa_snapshot s{snapshot(c.full()), snapshot(c.swa()), {}};
    for (kvcache::seq_id_t q = 0; q < static_cast<kvcache::seq_id_t>(c.n_seq_max()); ++q)
        s.pruned.push_back(c.swa().storage().pruned_below(q));
    return s;
}

/// Positions sequence s holds in cache c, sorted.
template <class Cache>
std::vector<kvcache::pos_t> positions_of(const Cache& c, kvcache::seq_id_t s) {
    std::vector<kvcache::pos_t> out;
    for (std::uint32_t cell : c.cells().used_cells())
        if (c.cells().seqs(cell).test(s)) out.push_back(c.cells().pos(cell));
    std::sort(out.begin(), out.end());
    return out;
}

}  // namespace kvtest
