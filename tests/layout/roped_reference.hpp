// Float64 reference for layout tests that move positions: it keeps every token ever
// written (never pruned), K before RoPE, and rotates K at the token's current position
// (reference/rope_ref.hpp), so a cache after seq_add / seq_div + K-shift is checked by
// decode attention with a sliding window against it.
#pragma once

#include <doctest/doctest.h>

#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/cells/seq_step.hpp>
#include <kvcache/ops/attention.hpp>
#include <kvcache/ops/rope.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "layout_test_util.hpp"
#include "reference/rope_ref.hpp"

namespace kvtest {

/// A token of the reference: K before RoPE and V, per layer (n_head_kv x dim floats).
struct roped_token {
    std::vector<std::vector<float>> k0, v;
};
/// One sequence of the reference: current position -> token (never pruned).
using roped_seq = std::multimap<kvcache::pos_t, roped_token>;

/// Places positions [p0, p0 + n) of sequence s with the same random K (RoPE at the
/// position) and V in cache c, in every cache of `more`, and in the reference, committing
/// each cache. Returns whether c accepted them (the others must when it does).
template <class Cache, class... More>
bool put_roped(Cache& c, std::vector<roped_seq>& ref, kvcache::seq_id_t s, kvcache::pos_t p0, std::uint32_t n,
               std::mt19937& rng, More&... more) {
    const auto& sh = c.shape();
    std::vector<kvcache::pos_t> pos(n);
    std::vector<kvcache::seq_id_t> seq(n, s);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = p0 + static_cast<kvcache::pos_t>(i);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<roped_token> toks(n);
    std::vector<std::vector<float>> ks(sh.n_layer), vs(sh.n_layer);
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        ks[l].resize(n * sh.k_row_size());
        vs[l].resize(n * sh.v_row_size());
        for (auto& x : ks[l]) x = u(rng);
        for (auto& x : vs[l]) x = u(rng);
        for (std::uint32_t i = 0; i < n; ++i) {
            toks[i].k0.emplace_back(ks[l].begin() + i * sh.k_row_size(), ks[l].begin() + (i + 1) * sh.k_row_size());
            toks[i].v.emplace_back(vs[l].begin() + i * sh.v_row_size(), vs[l].begin() + (i + 1) * sh.v_row_size());
        }
        kvcache::ops::rope_rows(ks[l].data(), n, sh.n_head_kv, sh.dim_k(), pos.data(), sh.rope);
    }
    auto write = [&](auto& cache) {
        auto r = cache.place(pos, seq);
        if (!r) return false;
        for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
            cache.write_k(l, r.value().cells, ks[l].data());
            cache.write_v(l, r.value().cells, vs[l].data());
        }
        cache.commit();
        return true;
    };
    if (!write(c)) return false;
    [[maybe_unused]] auto also = [&](auto& other) { REQUIRE(write(other)); };
    (also(more), ...);
    for (std::uint32_t i = 0; i < n; ++i) ref[static_cast<std::size_t>(s)].emplace(pos[i], toks[i]);
    return true;
}

/// The reference side of seq_add / seq_div on [p0, p1) (p1 < 0: to the end): new position
/// f(old), dropped when negative.
template <class F>
void ref_move(roped_seq& m, kvcache::pos_t p0, kvcache::pos_t p1, F f) {
    roped_seq out;
    for (auto& [p, t] : m) {
        const bool in = p >= std::max(p0, 0) && (p1 < 0 || p < p1);
        const std::int64_t np = in ? f(p) : p;
        if (np >= 0) out.emplace(static_cast<kvcache::pos_t>(np), t);
    }
    m = std::move(out);
}

/// The reference side of one sequence operation (seq_rm, seq_add or seq_div).
inline void ref_step(roped_seq& m, const kvcache::seq_step& st) {
    using op = kvcache::seq_step::op;
    if (st.kind == op::rm) {
        std::erase_if(m, [&](const auto& e) { return e.first >= std::max(st.p0, 0) && (st.p1 < 0 || e.first < st.p1); });
        return;
    }
    const std::int64_t a = st.arg;
    const bool add = st.kind == op::add;
    ref_move(m, st.p0, st.p1, [a, add](kvcache::pos_t p) { return add ? std::int64_t{p} + a : std::int64_t{p} / a; });
}

/// Decode-style attention of sequence s at query position qp, every layer, both kernel
/// paths: the cache (sliding window `window`) against float64 attention over the reference
/// tokens with positions in (qp - window, qp], K rotated to their current positions.
template <class Cache>
void check_roped_attention(const Cache& c, const roped_seq& ref, kvcache::seq_id_t s, kvcache::pos_t qp,
                           std::mt19937& rng, std::uint32_t window) {
    REQUIRE_FALSE(c.has_shift());
    const auto& sh = c.shape();
    const std::uint32_t n_head = 2 * sh.n_head_kv, dk = sh.dim_k(), dv = sh.dim_v(), group = n_head / sh.n_head_kv;
    std::vector<float> q(n_head * dk);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    kvcache::ops::attention_workspace ws;
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        for (auto& x : q) x = u(rng);
        for (kvcache::ops::kernel_path path : {kvcache::ops::kernel_path::scalar, kvcache::ops::kernel_path::simd}) {
            const auto out = decode_attention(c, l, q, qp, s, n_head, static_cast<std::int32_t>(window), path, ws);
            for (std::uint32_t g = 0; g < n_head; ++g) {
                const std::uint32_t h = g / group;
                std::vector<double> logit, acc(dv, 0.0);
                std::vector<const roped_token*> seen;
                double mx = -1e300;
                for (const auto& [p, t] : ref) {
                    if (p > qp || std::int64_t{p} <= std::int64_t{qp} - window) continue;
                    const std::vector<double> k0(t.k0[l].begin() + h * dk, t.k0[l].begin() + (h + 1) * dk);
                    const auto k = ref::rope_head(k0, p, sh.rope);
                    double dot = 0;
                    for (std::uint32_t d = 0; d < dk; ++d) dot += double{q[g * dk + d]} * k[d];
                    logit.push_back(dot / std::sqrt(double(dk)));
                    mx = std::max(mx, logit.back());
                    seen.push_back(&t);
                }
                REQUIRE_FALSE(seen.empty());
                double den = 0;
                for (std::size_t i = 0; i < seen.size(); ++i) {
                    const double e = std::exp(logit[i] - mx);
                    den += e;
                    for (std::uint32_t d = 0; d < dv; ++d) acc[d] += e * seen[i]->v[l][h * dv + d];
                }
                for (std::uint32_t d = 0; d < dv; ++d) REQUIRE(std::abs(out[g * dv + d] - acc[d] / den) < 2e-5);
            }
        }
    }
}

}  // namespace kvtest
