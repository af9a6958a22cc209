// Context shift (F13) and Self-Extend (F14) as sequence operations on a kv_cache: the
// validation of n_keep / n_discard, and the positions the cache holds afterwards compared
// with a plain model of the same steps and with the closed-form Self-Extend formula.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <vector>

#include "../../examples/demo/engine/context.hpp"
#include "../../examples/demo/engine/kshift_check.hpp"
#include "../../examples/demo/engine/model.hpp"

namespace {

using cache_t = kvcache::kv_cache<kvcache::f32>;

kvcache::model_shape shape(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 4;
    s.n_cells = n_cells;
    s.n_seq_max = 2;
    return s;
}

/// Appends n tokens to seq at positions from, from + 1, ... (K/V left at zero: only positions matter here).
void append(cache_t& c, kvcache::seq_id_t seq, kvcache::pos_t from, int n) {
    std::vector<kvcache::pos_t> pos(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) pos[static_cast<std::size_t>(i)] = from + i;
    const std::vector<kvcache::seq_id_t> s(pos.size(), seq);
    kvcache::transaction tx(c);
    static_cast<void>(c.place(pos, s).value());
    tx.commit();
}

std::map<kvcache::pos_t, std::uint32_t> positions_of(const cache_t& c, kvcache::seq_id_t s) {
    return c.cells().seq_positions(s);
}

}  // namespace

TEST_CASE("context shift plan: llama.cpp's default and validated bounds") {
    const auto p = demo::plan_context_shift(100, 10);
    CHECK(p.n_keep == 10);
    CHECK(p.n_discard == 45);
    CHECK(p.n_past_after == 55);
    CHECK(demo::plan_context_shift(100, 10, 90).n_past_after == 10);
    CHECK(demo::plan_context_shift(2, 0).n_discard == 1);
    CHECK_THROWS_WITH_AS(demo::plan_context_shift(100, -1), doctest::Contains("n_keep = -1"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::plan_context_shift(100, 101), doctest::Contains("n_keep = 101"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::plan_context_shift(100, 10, 91), doctest::Contains("n_discard = 91"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::plan_context_shift(100, 100), doctest::Contains("n_discard = 0"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::plan_context_shift(11, 10), doctest::Contains("n_discard = 0"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::plan_context_shift(-3, 0), doctest::Contains("n_past = -3"), std::invalid_argument);
}

TEST_CASE("context shift keeps n_keep tokens, drops n_discard and closes the gap") {
    cache_t c(shape(64));
    append(c, 0, 0, 40);
    append(c, 1, 0, 8);  // another sequence must not move
    const auto plan = demo::plan_context_shift(40, 4);  // discard 18
    const kvcache::pos_t n_past = demo::context_shift(c, 0, 40, plan);
    CHECK(n_past == 22);
    const auto pos = positions_of(c, 0);
    CHECK(pos.size() == 22);
    kvcache::pos_t expect = 0;
    for (const auto& [p, count] : pos) {
        CHECK(p == expect++);
        CHECK(count == 1);
    }
    CHECK(c.seq_pos_max(1) == 7);
    CHECK(c.used() == 22 + 8);
    // Cells that moved carry the delta for the K-shift: the ones after the discarded range.
    int shifted = 0;
    for (std::uint32_t cell : c.cells().used_cells()) {
        if (c.cells().shift(cell) != 0) {
            CHECK(c.cells().shift(cell) == -18);
            ++shifted;
        }
    }
    CHECK(shifted == 18);
    // Endless generation: shift whenever the context is full; memory stays constant.
    kvcache::pos_t np = n_past;
    const auto bytes = c.total_bytes();
    for (int step = 0; step < 500; ++step) {
        if (np + 1 >= 32) np = demo::context_shift(c, 0, np, demo::plan_context_shift(np, 4));
        append(c, 0, np, 1);
        ++np;
        REQUIRE(c.seq_pos_max(0) == np - 1);
        REQUIRE(c.cells().seq_cell_count(0) == static_cast<std::uint32_t>(np));
        c.clear_shifts();
    }
    CHECK(c.total_bytes() == bytes);
    CHECK(c.used() <= 32 + 8);
}

TEST_CASE("Self-Extend loop: positions match a plain model and the closed form") {
    struct params {
        int ga_n, ga_w, n_tokens, batch;
    };
    for (const params& prm : {params{4, 8, 40, 1}, params{2, 8, 37, 1}, params{4, 16, 50, 1}, params{4, 8, 64, 8},
                              params{8, 64, 300, 5}, params{1, 8, 20, 3}}) {
        CAPTURE(prm.ga_n);
        CAPTURE(prm.ga_w);
        CAPTURE(prm.batch);
        cache_t c(shape(512));
        demo::self_extend se(prm.ga_n, prm.ga_w);
        // Plain model: the position of every token, moved by the seed's loop on a vector.
        std::vector<kvcache::pos_t> model;
        kvcache::pos_t m_past = 0, m_ga_i = 0;
        auto model_loop = [&] {
            auto add = [&](kvcache::pos_t p0, kvcache::pos_t p1, kvcache::pos_t d) {
                for (auto& p : model)
                    if (p >= p0 && p < p1) p += d;
            };
            if (prm.ga_n == 1) return;
            while (m_past >= m_ga_i + prm.ga_w) {
                const int ib = (prm.ga_n * m_ga_i) / prm.ga_w;
                const int bd = (prm.ga_w / prm.ga_n) * (prm.ga_n - 1);
                const int dd = (prm.ga_w / prm.ga_n) - ib * bd - prm.ga_w;
                add(m_ga_i, m_past, ib * bd);
                for (auto& p : model)
                    if (p >= m_ga_i + ib * bd && p < m_ga_i + ib * bd + prm.ga_w) p /= prm.ga_n;
                add(m_ga_i + ib * bd + prm.ga_w, m_past + ib * bd, dd);
                m_past -= bd;
                m_ga_i += prm.ga_w / prm.ga_n;
            }
        };
        kvcache::pos_t n_past = 0;
        int added = 0;
        while (added < prm.n_tokens) {
            n_past = se.apply(c, 0, n_past);
            model_loop();
            REQUIRE(n_past == m_past);
            const int n = std::min(prm.batch, prm.n_tokens - added);
            append(c, 0, n_past, n);
            for (int i = 0; i < n; ++i) model.push_back(m_past + i);
            n_past += n;
            m_past += n;
            added += n;
            std::map<kvcache::pos_t, std::uint32_t> from_model;
            for (auto p : model) ++from_model[p];
            REQUIRE(positions_of(c, 0) == from_model);
            c.clear_shifts();
        }
        n_past = se.apply(c, 0, n_past);
        // The loop ran to completion: n_past is below the next window.
        if (prm.ga_n > 1) CHECK(n_past < se.ga_i() + prm.ga_w);
        // n_past formula.
        CHECK(n_past == prm.n_tokens - (prm.ga_n - 1) * se.ga_i());
        // Closed form for every token, compared with the cache's position multiset.
        std::map<kvcache::pos_t, std::uint32_t> want;
        for (int p = 0; p < prm.n_tokens; ++p) ++want[se.expected_pos(p)];
        CHECK(positions_of(c, 0) == want);
        if (prm.ga_n == 1) CHECK(se.ga_i() == 0);
    }
}

TEST_CASE("Self-Extend parameters are validated") {
    CHECK_THROWS_WITH_AS(demo::self_extend(0, 8), doctest::Contains("ga_n = 0"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::self_extend(4, 0), doctest::Contains("ga_w = 0"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(demo::self_extend(4, 10), doctest::Contains("multiple of ga_n = 4"), std::invalid_argument);
}

TEST_CASE("K-shift check: the library's K-shift passes it, a skipped rotation fails it") {
    const std::uint64_t seed = 77;
    std::printf("K-shift check: seed %llu\n", static_cast<unsigned long long>(seed));
    for (bool rotate : {true, false}) {
        kvcache::model_shape sh = shape(64);
        sh.n_layer = 2;
        sh.n_head_kv = 2;
        sh.head_dim_k = 8;
        cache_t c(sh);
        std::vector<kvcache::pos_t> pos(40);
        for (int i = 0; i < 40; ++i) pos[static_cast<std::size_t>(i)] = i;
        const std::vector<kvcache::seq_id_t> seq(pos.size(), 0);
        {
            kvcache::transaction tx(c);
            const auto cells = c.place(pos, seq).value().cells;
            demo::splitmix64 rng(seed);
            std::vector<float> rows(cells.size() * sh.k_row_size());
            for (auto& x : rows) x = static_cast<float>(rng.uniform() * 2 - 1);
            for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
                c.write_k(l, cells, rows.data());
                c.write_v(l, cells, rows.data());
            }
            tx.commit();
        }
        const auto before = demo::snapshot_k(c, 0, 0, 64);
        CHECK(before.size() == 40);
        demo::context_shift(c, 0, 40, demo::plan_context_shift(40, 4));  // positions 22..39 move by -18
        if (rotate)
            kvcache::ops::apply_k_shift(c);
        else
            c.clear_shifts();
        const demo::k_shift_report r = demo::check_k_shift(c, 0, before);
        CHECK(r.n_cells == 22);
        CHECK(r.n_moved == 18);
        if (rotate)
            CHECK(r.max_error <= 1e-6);
        else
            CHECK(r.max_error > 1e-2);
    }
}
