// Shared helpers of the layout tests: shapes, random K/V rows, a driver that applies
// the same operation to a cache and to the layout-independent reference model.
#pragma once

#include <kvcache/element/bf16.hpp>
#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/ops/attention.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "reference/layout_model.hpp"

namespace kvtest {

inline kvcache::model_shape layout_shape(std::uint32_t n_cells, std::uint32_t n_seq, std::uint32_t n_layer = 2,
                                         std::uint32_t n_head_kv = 2, std::uint32_t head_dim = 8) {
    kvcache::model_shape s;
    s.n_layer = n_layer;
    s.n_head_kv = n_head_kv;
    s.head_dim_k = head_dim;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

/// Places one micro-batch in the cache and, when it succeeds, in the model (and in
/// `twin` if given, e.g. a model that never prunes); writes random K/V rows (rounded
/// through the element type, as the cache stores them). Returns whether the cache
/// accepted the batch.
template <class Cache>
bool place_and_write(Cache& cache, layout_model& model, std::span<const kvcache::pos_t> pos,
                     std::span<const kvcache::seq_set> seqs, std::mt19937& rng, layout_model* twin = nullptr) {
    using element = typename Cache::element;
    auto r = cache.place(pos, seqs);
    if (!r) return false;
    const auto& sh = cache.shape();
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<model_token> toks(pos.size());
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        std::vector<float> k(pos.size() * sh.k_row_size()), v(pos.size() * sh.v_row_size());
        for (auto& x : k) x = u(rng);
        for (auto& x : v) x = u(rng);
        cache.write_k(l, r.value().cells, k.data());
        cache.write_v(l, r.value().cells, v.data());
        for (std::size_t i = 0; i < pos.size(); ++i) {
            std::vector<typename element::storage_type> tmp(std::max(sh.k_row_size(), sh.v_row_size()));
            std::vector<float> kr(k.begin() + static_cast<std::ptrdiff_t>(i * sh.k_row_size()),
                                  k.begin() + static_cast<std::ptrdiff_t>((i + 1) * sh.k_row_size()));
            std::vector<float> vr(v.begin() + static_cast<std::ptrdiff_t>(i * sh.v_row_size()),
                                  v.begin() + static_cast<std::ptrdiff_t>((i + 1) * sh.v_row_size()));
            element::from_float(kr.data(), tmp.data(), kr.size());
            element::to_float(tmp.data(), kr.data(), kr.size());
            element::from_float(vr.data(), tmp.data(), vr.size());
            element::to_float(tmp.data(), vr.data(), vr.size());
            toks[i].k.push_back(kr);
            toks[i].v.push_back(vr);
        }
    }
    for (layout_model* m : {&model, twin}) {
        if (m == nullptr) continue;
        m->begin_place();
        for (std::size_t i = 0; i < pos.size(); ++i)
            seqs[i].for_each([&](kvcache::seq_id_t s) { m->put(s, pos[i], toks[i]); });
    }
    return true;
}

/// Single-sequence convenience: n tokens of sequence s from position p0.
template <class Cache>
bool append(Cache& cache, layout_model& model, kvcache::seq_id_t s, kvcache::pos_t p0, std::uint32_t n,
            std::mt19937& rng) {
    std::vector<kvcache::pos_t> pos(n);
    std::vector<kvcache::seq_set> seqs(n, kvcache::seq_set::of(s));
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = p0 + static_cast<kvcache::pos_t>(i);
    return place_and_write(cache, model, pos, seqs, rng);
}

/// One decode query of sequence s at position qp over `layer` (q: n_head x dim_k floats),
/// sliding window `window` (0: none), through kernel `path`; returns n_head x dim_v floats.
template <class Cache>
std::vector<float> decode_attention(const Cache& cache, std::uint32_t layer, const std::vector<float>& q,
                                    kvcache::pos_t qp, kvcache::seq_id_t s, std::uint32_t n_head, std::int32_t window,
                                    kvcache::ops::kernel_path path, kvcache::ops::attention_workspace& ws) {
    std::vector<float> out(std::size_t{n_head} * cache.shape().dim_v());
    kvcache::ops::attention_params ap;
    ap.n_head = n_head;
    ap.window = window;
    ap.path = path;
    kvcache::ops::attention(cache, layer, q.data(), &qp, &s, 1, ap, out.data(), ws);
    return out;
}

}  // namespace kvtest
