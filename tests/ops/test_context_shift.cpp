// Context shift (F13) and Self-Extend (F14): positions against a plain simulation of
// the seed's loops, K after the K-shift against a direct RoPE at the new positions,
// and every invalid argument refused with the cache unchanged.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using kvcache::pos_t;
using kvcache::seq_id_t;

kvcache::model_shape shape_for(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = 2;
    s.head_dim_k = 16;
    s.head_dim_v = 8;
    s.rope = {kvcache::rope_type::neox, 10000.0f, 1.0f, 0};
    s.n_cells = n_cells;
    s.n_seq_max = 2;
    return s;
}

/// Fills sequence `seq` with positions [0, n); K of token p is rope(base(p), p), V = base.
template <class Cache>
void fill(Cache& c, seq_id_t seq, pos_t n, std::vector<std::vector<float>>& base) {
    const auto& sh = c.shape();
    std::vector<pos_t> pos(static_cast<std::size_t>(n));
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<seq_id_t> sq(pos.size(), seq);
    auto cells = c.place(pos, sq).value().cells;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    base.assign(pos.size(), std::vector<float>(sh.k_row_size()));
    std::vector<float> k, v(pos.size() * sh.v_row_size(), 0.5f);
    for (auto& row : base)
        for (auto& x : row) x = u(rng);
    for (std::size_t i = 0; i < pos.size(); ++i) k.insert(k.end(), base[i].begin(), base[i].end());
    kvcache::ops::rope_rows(k.data(), pos.size(), sh.n_head_kv, sh.head_dim_k, pos.data(), sh.rope);
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        c.write_k(l, cells, k.data());
        c.write_v(l, cells, v.data());
    }
    c.commit();
}

/// After apply_k_shift, every cell's K must equal rope(base(original position), current position).
template <class Cache>
void check_k_matches_positions(const Cache& c, const std::map<std::uint32_t, pos_t>& original,
                               const std::vector<std::vector<float>>& base) {
    const auto& sh = c.shape();
    std::vector<float> got(sh.k_row_size());
    double err = 0, ref = 0;
    for (const auto& [cell, p0] : original) {
        if (c.cells().is_free(cell)) continue;
        std::vector<float> want = base[static_cast<std::size_t>(p0)];
        const pos_t p = c.cells().pos(cell);
        kvcache::ops::rope_rows(want.data(), 1, sh.n_head_kv, sh.head_dim_k, &p, sh.rope);
        c.read_k(0, cell, got.data());
        for (std::size_t i = 0; i < got.size(); ++i) {
            err += std::fabs(double{got[i]} - want[i]);
            ref += std::fabs(double{want[i]});
        }
    }
    CHECK(err / ref < 1e-5);
}

std::map<std::uint32_t, pos_t> positions_by_cell(const kvcache::cell_table& t) {
    std::map<std::uint32_t, pos_t> m;
    for (std::uint32_t c : t.used_cells()) m[c] = t.pos(c);
    return m;
}

}  // namespace

TEST_CASE("context_shift keeps n_keep, discards n_discard, shifts the rest (F13)") {
    kvcache::kv_cache<> c(shape_for(64));
    std::vector<std::vector<float>> base;
    fill(c, 0, 60, base);
    const auto orig = positions_by_cell(c.cells());
    auto r = kvcache::ops::context_shift(c, 0, 4).value();  // default n_discard = (60 - 4) / 2 = 28
    CHECK(r.n_discard == 28);
    CHECK(r.n_past_after == 32);
    CHECK(c.used() == 32);
    CHECK(c.seq_pos_max(0) == 31);
    for (std::uint32_t cell : c.cells().used_cells()) {
        const pos_t was = orig.at(cell);
        CHECK((was < 4 || was >= 32));
        CHECK(c.cells().pos(cell) == (was < 4 ? was : was - 28));
    }
    kvcache::ops::apply_k_shift(c);
    CHECK_FALSE(c.has_shift());
    check_k_matches_positions(c, orig, base);
    // Memory stays constant: the freed cells take the next tokens.
    auto r2 = kvcache::ops::context_shift(c, 0, 0, 1).value();
    CHECK(r2.n_past_after == 31);
}

TEST_CASE("context_shift refuses invalid n_keep / n_discard and changes nothing") {
    kvcache::kv_cache<kvcache::f16> c(shape_for(32));
    std::vector<std::vector<float>> base;
    fill(c, 0, 20, base);
    auto refused = [&](auto f, const char* needle, kvcache::errc code = kvcache::errc::invalid_argument) {
        const auto before = kvtest::snapshot(c);
        const kvtest::refusal r = kvtest::run_refusal(f);  // arguments throw; no room is an error result
        REQUIRE_MESSAGE(r.kind != kvtest::refusal_kind::none, "accepted");
        CHECK(r.kind == kvtest::rule_kind(code));
        CHECK(r.code == code);
        CHECK_MESSAGE(r.message.find(needle) != std::string::npos, r.message);
        CHECK(kvtest::snapshot(c) == before);
    };
    refused([&] { return kvcache::ops::context_shift(c, 0, -1); }, "n_keep = -1");
    refused([&] { return kvcache::ops::context_shift(c, 0, 21); }, "n_keep = 21");
    refused([&] { return kvcache::ops::context_shift(c, 0, 4, -8); }, "n_discard = -8");  // the CVE case
    refused([&] { return kvcache::ops::context_shift(c, 0, 4, 0); }, "n_discard = 0");
    refused([&] { return kvcache::ops::context_shift(c, 0, 4, 17); }, "n_discard = 17");
    refused([&] { return kvcache::ops::context_shift(c, 0, 20); }, "n_discard = 0");  // nothing left to discard
    refused([&] { return kvcache::ops::context_shift(c, 3, 0); }, "seq_id = 3");
    // Shared cells need room to split: 12 free cells, 16 shared cells to move.
    REQUIRE(c.seq_cp(0, 1, -1, -1));
    refused([&] { return kvcache::ops::context_shift(c, 0, 0, 4); }, "needs 16 free cells", kvcache::errc::no_space);
}

TEST_CASE("self_extend positions follow the seed's loop; K equals RoPE at the new positions (F14)") {
    for (const auto& cfg : {std::tuple{4, 16, 70}, std::tuple{2, 8, 40}, std::tuple{8, 32, 130}}) {
        // named variables, not structured bindings: clang 14 cannot capture those (CAPTURE)
        const int ga_n = std::get<0>(cfg), ga_w = std::get<1>(cfg), n_past = std::get<2>(cfg);
        CAPTURE(ga_n);
        CAPTURE(ga_w);
        kvcache::kv_cache<> c(shape_for(160));
        std::vector<std::vector<float>> base;
        fill(c, 0, n_past, base);
        const auto orig = positions_by_cell(c.cells());
        // Plain simulation of the loop on a list of positions.
        std::vector<long> sim(static_cast<std::size_t>(n_past));
        std::iota(sim.begin(), sim.end(), 0L);
        long np = n_past, gi = 0;
        auto add = [&](long p0, long p1, long d) {
            for (auto& p : sim)
                if (p >= p0 && p < p1) p += d;
        };
        auto div = [&](long p0, long p1, long d) {
            for (auto& p : sim)
                if (p >= p0 && p < p1) p /= d;
        };
        while (np >= gi + ga_w) {
            const long ib = ga_n * gi / ga_w, bd = (ga_w / ga_n) * (ga_n - 1), dd = ga_w / ga_n - ib * bd - ga_w;
            add(gi, np, ib * bd);
            div(gi + ib * bd, gi + ib * bd + ga_w, ga_n);
            add(gi + ib * bd + ga_w, np + ib * bd, dd);
            np -= bd;
            gi += ga_w / ga_n;
        }
        kvcache::ops::self_extend_state st{ga_n, ga_w, 0};
        const pos_t got = kvcache::ops::self_extend(c, 0, st, n_past).value();
        CHECK(got == np);
        CHECK(st.ga_i == gi);
        for (const auto& [cell, p0] : orig) CHECK(c.cells().pos(cell) == sim[static_cast<std::size_t>(p0)]);
        kvcache::ops::apply_k_shift(c);
        check_k_matches_positions(c, orig, base);
    }
}

TEST_CASE("self_extend refuses invalid parameters and changes nothing") {
    kvcache::kv_cache<> c(shape_for(64));
    std::vector<std::vector<float>> base;
    fill(c, 0, 40, base);
    const auto before = kvtest::snapshot(c);
    for (auto st : {kvcache::ops::self_extend_state{0, 16, 0}, kvcache::ops::self_extend_state{4, 18, 0},
                    kvcache::ops::self_extend_state{4, 0, 0}, kvcache::ops::self_extend_state{4, 16, -1}}) {
        const auto copy = st;
        CHECK_THROWS_AS(static_cast<void>(kvcache::ops::self_extend(c, 0, st, 40)), kvcache::error);
        CHECK(st.ga_i == copy.ga_i);
    }
    kvcache::ops::self_extend_state ok{4, 16, 0};
    CHECK_THROWS_AS(static_cast<void>(kvcache::ops::self_extend(c, 0, ok, -5)), kvcache::error);
    CHECK_THROWS_AS(static_cast<void>(kvcache::ops::self_extend(c, 5, ok, 40)), kvcache::error);
    CHECK(kvtest::snapshot(c) == before);
    kvcache::ops::self_extend_state one{1, 16, 0};
    CHECK(kvcache::ops::self_extend(c, 0, one, 40).value() == 40);  // ga_n = 1: nothing to group
    CHECK(kvtest::snapshot(c) == before);
}
