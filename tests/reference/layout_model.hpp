// Layout-independent reference model for the layout tests: what every sequence sees.
//
// A sequence is a map position -> token (K and V rows of every layer, as floats
// after element rounding, plus the pending K-shift). The model applies placement,
// transactions and sequence operations with F5 semantics (sequences are independent
// values) and never looks at cells, so the same random operations can drive a
// contiguous, paged or ring cache and be compared sequence by sequence.
// attention_ref() is a float64 attention over one sequence's tokens.
#pragma once

#include <kvcache/element/bf16.hpp>
#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kvtest {

struct model_token {
    std::int32_t shift = 0;
    std::vector<std::vector<float>> k, v;  // per layer: n_head_kv x dim floats
    friend bool operator==(const model_token&, const model_token&) = default;
    friend auto operator<=>(const model_token&, const model_token&) = default;
};

/// A sequence: position -> token; a position may repeat (seq_add / seq_div can merge).
using model_seq = std::multimap<kvcache::pos_t, model_token>;

/// A sequence as a sorted list, for comparisons that ignore the order of repeats.
inline std::vector<std::pair<kvcache::pos_t, model_token>> sorted(const model_seq& m) {
    std::vector<std::pair<kvcache::pos_t, model_token>> v(m.begin(), m.end());
    std::sort(v.begin(), v.end());
    return v;
}
/// First difference between two sets of sequences, as text (empty when equal).
inline std::string diff(const std::vector<model_seq>& a, const std::vector<model_seq>& b) {
    for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
        const auto x = sorted(a[i]), y = sorted(b[i]);
        if (x == y) continue;
        std::string out = "sequence " + std::to_string(i) + ": ";
        for (const auto& [p, t] : x) out += std::to_string(p) + (t.shift ? "s" + std::to_string(t.shift) : "") + " ";
        out += "| ";
        for (const auto& [p, t] : y) out += std::to_string(p) + (t.shift ? "s" + std::to_string(t.shift) : "") + " ";
        return out;
    }
    return {};
}
inline bool same(const std::vector<model_seq>& a, const std::vector<model_seq>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
        if (sorted(a[i]) != sorted(b[i])) return false;
    return true;
}

class layout_model {
public:
    explicit layout_model(std::uint32_t n_seq) : seqs(n_seq) {}

    std::vector<model_seq> seqs;
    std::vector<std::vector<model_seq>> tx_before;  // sequences before the first staged placement

    void begin_place() {
        if (tx_before.empty()) tx_before.push_back(seqs);
    }
    void put(kvcache::seq_id_t s, kvcache::pos_t p, const model_token& t) { seqs[idx(s)].emplace(p, t); }
    void commit() { tx_before.clear(); }
    void restore() {
        if (tx_before.empty()) return;
        seqs = tx_before.front();
        tx_before.clear();
    }
    static bool in(kvcache::pos_t p, kvcache::pos_t p0, kvcache::pos_t p1) {
        const std::int64_t lo = p0 < 0 ? 0 : p0;
        const std::int64_t hi = p1 < 0 ? std::int64_t{1} << 40 : p1;
        return p >= lo && p < hi;
    }
    void seq_rm(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1) {
        for (std::size_t t = 0; t < seqs.size(); ++t) {
            if (s >= 0 && idx(s) != t) continue;
            std::erase_if(seqs[t], [&](const auto& e) { return in(e.first, p0, p1); });
        }
    }
    /// Positions dst already holds are cells it already shares with src (the cache refuses
    /// a copy onto a position dst holds in another cell; the caller checks that first).
    void seq_cp(kvcache::seq_id_t src, kvcache::seq_id_t dst, kvcache::pos_t p0, kvcache::pos_t p1) {
        if (src == dst) return;
        const model_seq held = seqs[idx(dst)];
        for (const auto& [p, tok] : seqs[idx(src)])
            if (in(p, p0, p1) && held.count(p) == 0) seqs[idx(dst)].emplace(p, tok);
    }
    void seq_keep(kvcache::seq_id_t s) {
        for (std::size_t t = 0; t < seqs.size(); ++t)
            if (t != idx(s)) seqs[t].clear();
    }
    template <class F>
    void move(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1, F f) {
        for (std::size_t t = 0; t < seqs.size(); ++t) {
            if (s >= 0 && idx(s) != t) continue;
            model_seq out;
            for (auto& [p, tok] : seqs[t]) {
                if (!in(p, p0, p1)) {
                    out.emplace(p, tok);
                    continue;
                }
                const std::int64_t np = f(p);
                if (np < 0) continue;
                model_token moved = tok;
                moved.shift += static_cast<std::int32_t>(np - p);
                out.emplace(static_cast<kvcache::pos_t>(np), moved);
            }
            seqs[t] = std::move(out);
        }
    }
    void seq_add(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1, kvcache::pos_t d) {
        if (d != 0) move(s, p0, p1, [d](kvcache::pos_t p) { return std::int64_t{p} + d; });
    }
    void seq_div(kvcache::seq_id_t s, kvcache::pos_t p0, kvcache::pos_t p1, int d) {
        if (d != 1) move(s, p0, p1, [d](kvcache::pos_t p) { return std::int64_t{p} / d; });
    }
    /// Keeps only the last `window` positions of every sequence (ring pruning).
    void prune(std::uint32_t window) {
        for (auto& m : seqs) {
            if (m.empty()) continue;
            const std::int64_t lim = std::int64_t{m.rbegin()->first} - window + 1;
            std::erase_if(m, [&](const auto& e) { return e.first < lim; });
        }
    }
    void clear() {
        for (auto& m : seqs) m.clear();
        tx_before.clear();
    }

private:
    static std::size_t idx(kvcache::seq_id_t s) { return static_cast<std::size_t>(s); }
};

/// Reads what the cache holds for every sequence, in the model's terms.
template <class Cache>
std::vector<model_seq> observe(const Cache& cache) {
    const auto& sh = cache.shape();
    std::vector<model_seq> out(sh.n_seq_max);
    const auto& cells = cache.cells();
    std::vector<float> k(sh.k_row_size()), v(sh.v_row_size());
    for (std::uint32_t c : cells.used_cells()) {
        model_token t;
        t.shift = cells.shift(c);
        for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
            cache.read_k(l, c, k.data());
            cache.read_v(l, c, v.data());
            t.k.push_back(k);
            t.v.push_back(v);
        }
        cells.seqs(c).for_each([&](kvcache::seq_id_t s) { out[static_cast<std::size_t>(s)].emplace(cells.pos(c), t); });
    }
    return out;
}

/// float64 attention of one query head row over the tokens of `seq` visible from q_pos
/// (causal; window > 0 keeps positions > q_pos - window). K is used as stored: callers
/// compare caches holding the same K (pending shifts are the caller's concern).
inline std::vector<double> attention_ref(const model_seq& seq, std::uint32_t layer, std::uint32_t kv_head,
                                         std::uint32_t dim_k, std::uint32_t dim_v, const float* q, kvcache::pos_t q_pos,
                                         std::int32_t window) {
    std::vector<double> logits;
    std::vector<const model_token*> toks;
    for (const auto& [p, t] : seq) {
        if (p > q_pos || (window > 0 && std::int64_t{p} <= std::int64_t{q_pos} - window)) continue;
        double sc = 0;
        for (std::uint32_t d = 0; d < dim_k; ++d) sc += double{q[d]} * t.k[layer][kv_head * dim_k + d];
        logits.push_back(sc / std::sqrt(double(dim_k)));
        toks.push_back(&t);
    }
    std::vector<double> out(dim_v, 0.0);
    if (toks.empty()) return out;
    double m = logits[0];
    for (double x : logits) m = std::max(m, x);
    double l = 0;
    for (std::size_t i = 0; i < toks.size(); ++i) {
        const double w = std::exp(logits[i] - m);
        l += w;
        for (std::uint32_t d = 0; d < dim_v; ++d) out[d] += w * toks[i]->v[layer][kv_head * dim_v + d];
    }
    for (double& x : out) x /= l;
    return out;
}

}  // namespace kvtest
