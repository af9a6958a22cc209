// Test helper: a complete, comparable picture of a kv_cache (every cell's metadata,
// every index the cache answers queries from, and the raw bytes of every K/V buffer),
// used to check that a refused call leaves the cache bit-identical.
#pragma once

#include <kvcache/kvcache.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvtest {

struct cache_snapshot {
    std::vector<kvcache::pos_t> pos;
    std::vector<std::int32_t> shift;
    std::vector<kvcache::seq_set> seqs;
    std::vector<kvcache::mrope_pos> ext;  // M-RoPE extra positions (zero without M-RoPE)
    std::vector<kvcache::pos_t> seq_min, seq_max;
    std::uint32_t used = 0;
    std::uint32_t window = 0;
    bool in_tx = false;
    std::vector<unsigned char> bytes;  // raw K then V of every layer
    friend bool operator==(const cache_snapshot&, const cache_snapshot&) = default;
};

template <class Cache>
cache_snapshot snapshot(const Cache& cache) {
    cache_snapshot s;
    const auto& cells = cache.cells();
    for (std::uint32_t c = 0; c < cells.size(); ++c) {
        s.pos.push_back(cells.pos(c));
        s.shift.push_back(cells.shift(c));
        s.seqs.push_back(cells.seqs(c));
        s.ext.push_back(cells.ext(c));
    }
    for (kvcache::seq_id_t q = 0; q < static_cast<kvcache::seq_id_t>(cache.shape().n_seq_max); ++q) {
        s.seq_min.push_back(cache.seq_pos_min(q));
        s.seq_max.push_back(cache.seq_pos_max(q));
    }
    s.used = cache.used();
    s.window = cache.n_window();
    s.in_tx = cache.in_transaction();
    using T = typename Cache::storage_type;
    for (std::uint32_t l = 0; l < cache.shape().n_layer; ++l) {
        const auto v = cache.storage().view(l);
        const std::size_t nk = v.k_head_stride * v.n_head_kv * sizeof(T);
        const std::size_t nv = v.v_head_stride * v.n_head_kv * sizeof(T);
        const auto* kb = reinterpret_cast<const unsigned char*>(v.k);
        const auto* vb = reinterpret_cast<const unsigned char*>(v.v);
        s.bytes.insert(s.bytes.end(), kb, kb + nk);
        s.bytes.insert(s.bytes.end(), vb, vb + nv);
    }
    return s;
}

}  // namespace kvtest
