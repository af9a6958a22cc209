// Shared helpers of the state I/O tests: random caches built through the public
// API (holes, shared cells, pending shifts), byte patching with a fresh checksum,
// a layout-independent picture of a cache, and a double-precision attention oracle.
#pragma once

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string_view>
#include <tuple>
#include <vector>

namespace kvtest {

using kvcache::pos_t;
using kvcache::seq_id_t;

inline kvcache::model_shape io_shape(std::uint32_t n_cells = 64, std::uint32_t n_seq = 4, std::uint32_t n_layer = 2,
                                     std::uint32_t n_head_kv = 2, std::uint32_t head_dim_k = 8,
                                     std::uint32_t head_dim_v = 0) {
    kvcache::model_shape s;
    s.n_layer = n_layer;
    s.n_head_kv = n_head_kv;
    s.head_dim_k = head_dim_k;
    s.head_dim_v = head_dim_v;
    s.n_cells = n_cells;
    s.n_seq_max = n_seq;
    return s;
}

/// A test layout that cannot move positions and declares a window: the contiguous
/// storage under other rules (for the checks that depend on can_shift and window).
template <std::uint32_t W>
struct no_shift_layout {
    using policy_kind = kvcache::layout_tag;
    static constexpr std::string_view name = "no_shift_test";
    static constexpr std::uint32_t layout_id = 100;
    static constexpr bool can_shift = false;
    static constexpr kvcache::v_layout v_arrangement = kvcache::v_layout::row_major;
    static constexpr std::uint32_t window = W;
    template <class E>
    struct storage : kvcache::tiled_kv_storage<E, kvcache::v_layout::row_major> {
        using kvcache::tiled_kv_storage<E, kvcache::v_layout::row_major>::tiled_kv_storage;
        // The window reaches state fingerprints through the declared capability.
        static constexpr kvcache::layout_caps capabilities = kvcache::layout_caps::sliding_window;
        static constexpr std::uint32_t window() noexcept { return W; }
    };
};

/// Places `n` consecutive positions of sequence s after its last one and writes random
/// K/V in every layer. Returns false (nothing placed) when the cache refuses.
template <class Cache>
bool append(Cache& c, seq_id_t s, std::uint32_t n, std::mt19937& rng) {
    const pos_t start = c.seq_pos_max(s) + 1;
    std::vector<pos_t> pos(n);
    std::vector<seq_id_t> seq(n, s);
    for (std::uint32_t i = 0; i < n; ++i) pos[i] = start + static_cast<pos_t>(i);
    auto r = c.place(pos, seq);
    if (!r) return false;
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    const auto& sh = c.shape();
    std::vector<float> k(n * sh.k_row_size()), v(n * sh.v_row_size());
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        for (auto& x : k) x = u(rng);
        for (auto& x : v) x = u(rng);
        c.write_k(l, r.value().cells, k.data());
        c.write_v(l, r.value().cells, v.data());
    }
    static_cast<void>(c.commit());
    return true;
}

/// A random history: appends, shared prefixes (seq_cp), partial removals and, when the
/// layout can shift, seq_add / seq_div (which leave pending shifts and may create two
/// cells of one sequence at the same position).
template <class Cache>
void random_history(Cache& c, std::mt19937& rng, int steps) {
    const auto n_seq = static_cast<seq_id_t>(c.shape().n_seq_max);
    std::uniform_int_distribution<seq_id_t> pick(0, n_seq - 1);
    for (int i = 0; i < steps; ++i) {
        const seq_id_t s = pick(rng);
        switch (rng() % 6) {
            case 0:
            case 1: append(c, s, 1 + rng() % 7, rng); break;
            case 2: {
                const seq_id_t t = pick(rng);
                if (t != s && c.seq_pos_max(t) < 0 && c.seq_pos_max(s) >= 0)  // a ring may refuse: nothing changed
                    static_cast<void>(c.seq_cp(s, t, 0, c.seq_pos_max(s) / 2 + 1));
                break;
            }
            case 3:
                if (c.seq_pos_max(s) > 2) {
                    const pos_t a = static_cast<pos_t>(rng() % static_cast<std::uint32_t>(c.seq_pos_max(s)));
                    // a layout may refuse (ring: pruned data): an error result, nothing changed
                    static_cast<void>(c.seq_rm(s, a, a + 2));
                }
                break;
            default:
                if constexpr (Cache::layout::can_shift) {
                    // no free cell for a split, or a ring's pruned positions: an error result, nothing changed
                    if (rng() % 2)
                        static_cast<void>(c.seq_add(s, 2, -1, static_cast<pos_t>(rng() % 5) - 2));
                    else
                        static_cast<void>(c.seq_div(s, 0, -1, 2));
                }
        }
    }
}

/// Recomputes the checksum after a test patched the bytes.
inline void reseal(std::vector<std::byte>& b) {
    if (b.size() < 8) return;
    const std::uint64_t h = kvcache::io::checksum(std::span<const std::byte>(b.data(), b.size() - 8));
    std::memcpy(b.data() + b.size() - 8, &h, 8);
}

template <class T>
void patch(std::vector<std::byte>& b, std::size_t off, T v) {
    std::memcpy(b.data() + off, &v, sizeof(T));
}
/// A copy of b with value v at offset `at` and a fresh checksum.
template <class T>
std::vector<std::byte> patched(std::vector<std::byte> b, std::size_t at, T v) {
    patch(b, at, v);
    reseal(b);
    return b;
}
template <class T>
T peek(const std::vector<std::byte>& b, std::size_t off) {
    T v;
    std::memcpy(&v, b.data() + off, sizeof(T));
    return v;
}

/// A cell independent of where it lives: position, pending shift, sequences, raw K/V bytes.
struct cell_picture {
    pos_t pos;
    std::int32_t shift;
    std::vector<seq_id_t> seqs;
    std::vector<unsigned char> kv;
    friend auto operator<=>(const cell_picture&, const cell_picture&) = default;
};

/// Every used cell (only those of `only` if >= 0, seen as sequence `as`), sorted.
template <class Cache>
std::vector<cell_picture> picture(const Cache& c, seq_id_t only = -1, seq_id_t as = -1) {
    using T = typename Cache::storage_type;
    std::vector<cell_picture> out;
    std::vector<T> row;
    for (std::uint32_t cell : c.cells().used_cells()) {
        if (only >= 0 && !c.cells().seqs(cell).test(only)) continue;
        cell_picture p{c.cells().pos(cell), c.cells().shift(cell), {}, {}};
        if (only >= 0)
            p.seqs.push_back(as);
        else
            c.cells().seqs(cell).for_each([&](seq_id_t s) { p.seqs.push_back(s); });
        for (std::uint32_t l = 0; l < c.shape().n_layer; ++l)
            for (bool is_v : {false, true}) {
                c.storage().cell_bytes(l, cell, is_v, row);
                const auto* b = reinterpret_cast<const unsigned char*>(row.data());
                p.kv.insert(p.kv.end(), b, b + row.size() * sizeof(T));
            }
        out.push_back(std::move(p));
    }
    std::sort(out.begin(), out.end());
    return out;
}

/// Attention of one query (all KV heads, one query head per KV head) for sequence s at
/// position p, in double, over the cells of s with pos <= p (and pos > p - window when
/// window > 0), summed in a fixed order (position, then K/V bytes) so that the result
/// does not depend on cell numbering.
template <class Cache>
std::vector<double> attention_oracle(const Cache& c, seq_id_t s, pos_t p, const std::vector<float>& q,
                                     pos_t window = 0) {
    const auto& sh = c.shape();
    const std::uint32_t dk = sh.dim_k(), dv = sh.dim_v();
    std::vector<std::uint32_t> ids;
    for (std::uint32_t cell : c.cells().used_cells()) {
        const pos_t cp = c.cells().pos(cell);
        if (!c.cells().seqs(cell).test(s) || cp > p || (window > 0 && cp <= p - window)) continue;
        ids.push_back(cell);
    }
    std::vector<float> k(sh.k_row_size()), v(sh.v_row_size());
    std::vector<std::tuple<pos_t, std::vector<float>, std::vector<float>>> rows;
    std::vector<double> out;
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        rows.clear();
        for (std::uint32_t cell : ids) {
            c.read_k(l, cell, k.data());
            c.read_v(l, cell, v.data());
            rows.emplace_back(c.cells().pos(cell), k, v);
        }
        std::sort(rows.begin(), rows.end());
        for (std::uint32_t h = 0; h < sh.n_head_kv; ++h) {
            std::vector<double> logit;
            double mx = -1e300;
            for (const auto& [pp, kr, vr] : rows) {
                double dot = 0;
                for (std::uint32_t d = 0; d < dk; ++d) dot += double{q[h * dk + d]} * kr[h * dk + d];
                logit.push_back(dot / std::sqrt(double(dk)));
                mx = std::max(mx, logit.back());
            }
            double den = 0;
            std::vector<double> acc(dv, 0.0);
            for (std::size_t i = 0; i < rows.size(); ++i) {
                const double w = std::exp(logit[i] - mx);
                den += w;
                for (std::uint32_t d = 0; d < dv; ++d) acc[d] += w * std::get<2>(rows[i])[h * dv + d];
            }
            for (std::uint32_t d = 0; d < dv; ++d) out.push_back(den > 0 ? acc[d] / den : 0.0);
        }
    }
    return out;
}

}  // namespace kvtest
