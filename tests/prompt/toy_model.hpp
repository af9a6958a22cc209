// A toy "model" for prefix-cache tests: computes deterministic K/V rows for a
// prompt's positions and writes them into a kv_cache sequence, the way a host
// engine would after slot_manager::prepare.
//
// K(i) = RoPE(base_k(i), pos = i) and V(i) = base_v(i), where base_* hash the
// token (or media chunk id and offset) and, unless context_free, the whole prefix
// [0, i] (as a real model's K/V depend on every earlier token). Computed in
// double, stored as float.
#pragma once

#include <kvcache/kvcache.hpp>
#include <kvcache/tokens/prompt_tokens.hpp>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace toy {

/// a followed by b.
inline kvcache::prompt_tokens cat(const kvcache::prompt_tokens& a, const kvcache::prompt_tokens& b) {
    kvcache::prompt_tokens out = a;
    out.append(b.tokens());
    return out;
}

inline kvcache::model_shape shape(std::uint32_t n_cells, std::uint32_t n_seq = 8) {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 8;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

inline std::uint64_t mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/// Per-position identity: token id, or media chunk id and offset.
inline std::uint64_t symbol(const kvcache::prompt_tokens& p, std::size_t i) {
    if (p[i] != kvcache::null_token) return static_cast<std::uint64_t>(p[i]);
    const auto* c = p.chunk_at(i);
    return mix(c->id) ^ (i - c->begin) ^ (std::uint64_t{1} << 63);
}

/// Rolling hash of positions [0, i] for every i.
inline std::vector<std::uint64_t> prefix_hashes(const kvcache::prompt_tokens& p) {
    std::vector<std::uint64_t> h(p.size());
    std::uint64_t acc = 0;
    for (std::size_t i = 0; i < p.size(); ++i) h[i] = acc = mix(acc ^ symbol(p, i));
    return h;
}

/// K and V rows (all layers) of position i: k[layer][n_head_kv * dim], v likewise.
struct rows {
    std::vector<std::vector<float>> k, v;
};

inline double unit(std::uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53 * 2.0 - 1.0; }

/// RoPE of a head row in double (normal pair layout), position p.
inline void rope(std::vector<double>& x, std::uint32_t dim, const kvcache::rope_params& rp, double p) {
    const std::uint32_t n_rot = rp.n_rot == 0 ? dim : rp.n_rot;
    for (std::size_t h = 0; h < x.size() / dim; ++h)
        for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
            const double th = p * rp.freq_scale * std::pow(static_cast<double>(rp.freq_base), -2.0 * i / n_rot);
            double& a = x[h * dim + 2 * i];
            double& b = x[h * dim + 2 * i + 1];
            const double a0 = a, b0 = b;
            a = a0 * std::cos(th) - b0 * std::sin(th);
            b = a0 * std::sin(th) + b0 * std::cos(th);
        }
}

/// Identity of each position: its symbol (context_free) or the hash of its whole prefix.
inline std::vector<std::uint64_t> keys(const kvcache::prompt_tokens& p, bool context_free) {
    if (!context_free) return prefix_hashes(p);
    std::vector<std::uint64_t> k(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) k[i] = symbol(p, i);
    return k;
}

inline rows compute(const kvcache::model_shape& s, std::uint64_t key, kvcache::pos_t pos) {
    rows r;
    for (std::uint32_t l = 0; l < s.n_layer; ++l) {
        std::vector<double> k(s.k_row_size()), v(s.v_row_size());
        for (std::size_t d = 0; d < k.size(); ++d) k[d] = unit(mix(key * 31 + l * 1000 + d));
        for (std::size_t d = 0; d < v.size(); ++d) v[d] = unit(mix(key * 37 + l * 1000 + d + 500));
        rope(k, s.dim_k(), s.rope, pos);
        r.k.emplace_back(k.begin(), k.end());
        r.v.emplace_back(v.begin(), v.end());
    }
    return r;
}

/// Computes prompt positions [from, to) into sequence seq (one micro-batch), like a host engine.
template <class Cache>
void fill(Cache& cache, kvcache::seq_id_t seq, const kvcache::prompt_tokens& p, std::size_t from, std::size_t to,
          bool context_free = false) {
    if (from >= to) return;
    std::vector<kvcache::pos_t> pos(to - from);
    std::iota(pos.begin(), pos.end(), static_cast<kvcache::pos_t>(from));
    std::vector<kvcache::seq_id_t> seqs(pos.size(), seq);
    kvcache::transaction tx(cache);
    auto placed = cache.place(pos, seqs).value();
    const auto& s = cache.shape();
    const auto ks = keys(p, context_free);
    std::vector<rows> all;
    for (std::size_t i = from; i < to; ++i) all.push_back(compute(s, ks[i], static_cast<kvcache::pos_t>(i)));
    for (std::uint32_t l = 0; l < s.n_layer; ++l) {
        std::vector<float> kr, vr;
        for (const rows& r : all) {
            kr.insert(kr.end(), r.k[l].begin(), r.k[l].end());
            vr.insert(vr.end(), r.v[l].begin(), r.v[l].end());
        }
        cache.write_k(l, placed.cells, kr.data());
        cache.write_v(l, placed.cells, vr.data());
    }
    tx.commit();
}

/// Cell of sequence seq at position p, or -1.
template <class Cache>
long cell_of(const Cache& cache, kvcache::seq_id_t seq, kvcache::pos_t p) {
    for (std::uint32_t c : cache.cells().used_cells())
        if (cache.cells().seqs(c).test(seq) && cache.cells().pos(c) == p) return c;
    return -1;
}

/// Largest |difference| between the cached K/V of seq at positions [from, n) and a fresh
/// computation of p's prefix at the same positions. Missing cells count as infinity.
template <class Cache>
double max_error(const Cache& cache, kvcache::seq_id_t seq, const kvcache::prompt_tokens& p, std::size_t n,
                 bool context_free = false, std::size_t from = 0) {
    const auto& s = cache.shape();
    double worst = 0;
    std::vector<float> row(std::max(s.k_row_size(), s.v_row_size()));
    const auto ks = keys(p, context_free);
    for (std::size_t i = from; i < n; ++i) {
        const long c = cell_of(cache, seq, static_cast<kvcache::pos_t>(i));
        if (c < 0) return INFINITY;
        const rows r = compute(s, ks[i], static_cast<kvcache::pos_t>(i));
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            cache.read_k(l, static_cast<std::uint32_t>(c), row.data());
            for (std::size_t d = 0; d < s.k_row_size(); ++d) worst = std::max(worst, std::fabs(double(row[d]) - r.k[l][d]));
            cache.read_v(l, static_cast<std::uint32_t>(c), row.data());
            for (std::size_t d = 0; d < s.v_row_size(); ++d) worst = std::max(worst, std::fabs(double(row[d]) - r.v[l][d]));
        }
    }
    return worst;
}

/// Prompt of n text tokens: ids start, start + 1, ...
inline kvcache::prompt_tokens text(std::size_t n, kvcache::token_t start = 1000) {
    kvcache::prompt_tokens p;
    for (std::size_t i = 0; i < n; ++i) p.push_back(start + static_cast<kvcache::token_t>(i));
    return p;
}

}  // namespace toy
