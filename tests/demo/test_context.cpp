// The demo's context shift (F13), Self-Extend (F14) and chunk-reuse check: the steps of
// examples/demo/scenarios.hpp call kvcache::ops::context_shift / kvcache::ops::self_extend
// (a twin cache driven by the library call directly ends bit-identical), and the positions
// they leave are compared with plain models of the same steps and with the closed form.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <vector>

#include "../../examples/demo/engine/kshift_check.hpp"
#include "../../examples/demo/engine/model.hpp"
#include "../../examples/demo/scenarios.hpp"
#include "support/result_check.hpp"

namespace {

using cache_t = kvcache::kv_cache<kvcache::f32>;
namespace sc = demo::scenarios;

kvcache::model_shape shape(std::uint32_t n_cells) {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 4;
    s.n_cells = n_cells;
    s.n_seq_max = 2;
    return s;
}

/// Appends n tokens to seq at positions from, from + 1, ... with random K/V when rng is given
/// (zero otherwise: then only positions matter).
void append(cache_t& c, kvcache::seq_id_t seq, kvcache::pos_t from, int n, demo::splitmix64* rng = nullptr) {
    std::vector<kvcache::pos_t> pos(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) pos[static_cast<std::size_t>(i)] = from + i;
    const std::vector<kvcache::seq_id_t> s(pos.size(), seq);
    kvcache::transaction tx(c);
    const auto cells = c.place(pos, s).value().cells;
    if (rng != nullptr) {
        const auto& sh = c.shape();
        std::vector<float> rows(cells.size() * std::max(sh.k_row_size(), sh.v_row_size()));
        for (auto& x : rows) x = static_cast<float>(rng->uniform() * 2 - 1);
        for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
            c.write_k(l, cells, rows.data());
            c.write_v(l, cells, rows.data());
        }
    }
    tx.commit();
}

std::map<kvcache::pos_t, std::uint32_t> positions_of(const cache_t& c, kvcache::seq_id_t s) {
    return c.cells().seq_positions(s);
}

/// Cell by cell: same position, same pending shift, same sequences (0 and 1), same K.
bool same_cells(const cache_t& a, const cache_t& b) {
    if (a.cells().used_cells() != b.cells().used_cells()) return false;
    std::vector<float> ka(a.shape().k_row_size()), kb(b.shape().k_row_size());
    for (std::uint32_t c : a.cells().used_cells()) {
        if (a.cells().pos(c) != b.cells().pos(c) || a.cells().shift(c) != b.cells().shift(c)) return false;
        for (kvcache::seq_id_t s : {0, 1})
            if (a.cells().seqs(c).test(s) != b.cells().seqs(c).test(s)) return false;
        for (std::uint32_t l = 0; l < a.shape().n_layer; ++l) {
            a.read_k(l, c, ka.data());
            b.read_k(l, c, kb.data());
            if (ka != kb) return false;
        }
    }
    return true;
}

/// The reference closed form of Self-Extend (independent of the demo's).
kvcache::pos_t closed_form(int ga_n, kvcache::pos_t ga_i, kvcache::pos_t p) {
    return p < ga_n * ga_i ? p / ga_n : p - (ga_n - 1) * ga_i;
}

}  // namespace

TEST_CASE("context shift: the library's default n_discard and its validation, cache unchanged on refusal") {
    cache_t c(shape(128));
    append(c, 0, 0, 100);
    const auto used = c.used();
    auto refused = [&](kvcache::pos_t n_keep, std::optional<kvcache::pos_t> n_discard, const char* what) {
        CAPTURE(n_keep);
        CHECK_THROWS_WITH_AS(static_cast<void>(kvcache::ops::context_shift(c, 0, n_keep, n_discard)),
                             doctest::Contains(what), kvcache::error);
        CHECK(c.used() == used);
        CHECK(c.seq_pos_max(0) == 99);
        CHECK_FALSE(c.has_shift());
    };
    refused(-1, std::nullopt, "n_keep = -1");
    refused(101, std::nullopt, "n_keep = 101");
    refused(10, 91, "n_discard = 91");
    refused(10, 0, "n_discard = 0");
    refused(10, -5, "n_discard = -5");  // llama.cpp's CVE-2026-21869: a negative n_discard
    refused(100, std::nullopt, "n_discard = 0");
    // The demo's step throws what the library throws, before changing anything.
    CHECK_THROWS_WITH_AS(sc::context_shift_step(c, 0, 101), doctest::Contains("n_keep = 101"), kvcache::error);
    CHECK(c.used() == used);
    // llama.cpp's default: discard (n_past - n_keep) / 2.
    const auto r = kvcache::ops::context_shift(c, 0, 10).value();
    CHECK(r.n_keep == 10);
    CHECK(r.n_discard == 45);
    CHECK(r.n_past_after == 55);
    cache_t d(shape(16));
    append(d, 0, 0, 11);
    CHECK_THROWS_WITH_AS(static_cast<void>(kvcache::ops::context_shift(d, 0, 10)),
                         doctest::Contains("n_discard = 0"), kvcache::error);
    CHECK(kvcache::ops::context_shift(d, 0, 0, 10).value().n_past_after == 1);
}

TEST_CASE("context shift step: kvcache::ops::context_shift, then the K-shift; positions as a plain model says") {
    demo::splitmix64 rng(5);
    cache_t c(shape(64)), twin(shape(64));
    for (cache_t* x : {&c, &twin}) {
        demo::splitmix64 r(5);
        append(*x, 0, 0, 40, &r);
        append(*x, 1, 0, 8, &r);  // another sequence must not move
    }
    // The library call alone: the moved cells carry the delta for the K-shift.
    const auto direct = kvcache::ops::context_shift(twin, 0, 4).value();  // discard 18
    CHECK(direct.n_past_after == 22);
    int shifted = 0;
    for (std::uint32_t cell : twin.cells().used_cells())
        if (twin.cells().shift(cell) != 0) {
            CHECK(twin.cells().shift(cell) == -18);
            ++shifted;
        }
    CHECK(shifted == 18);
    kvcache::ops::apply_k_shift(twin);
    // The demo's step: the same call (the caches end identical) plus its checks.
    const sc::shift_step st = sc::context_shift_step(c, 0, 4);
    CHECK(same_cells(c, twin));
    CHECK(st.plan.n_keep == 4);
    CHECK(st.plan.n_discard == 18);
    CHECK(st.plan.n_past_after == 22);
    CHECK(st.contiguous);
    CHECK(st.kshift_ok);
    CHECK(st.kshift.n_moved == 18);
    CHECK(st.kshift.max_error <= 1e-6);
    // Reference: the plain model of the positions.
    std::map<kvcache::pos_t, std::uint32_t> want;
    for (kvcache::pos_t p = 0; p < 22; ++p) want[p] = 1;
    CHECK(positions_of(c, 0) == want);
    CHECK(c.seq_pos_max(1) == 7);
    CHECK(c.used() == 22 + 8);
    // Endless generation: shift whenever the context is full; memory stays constant.
    kvcache::pos_t np = st.plan.n_past_after;
    const auto bytes = c.total_bytes();
    int shifts = 0;
    for (int step = 0; step < 500; ++step) {
        if (np + 1 >= 32) {
            const sc::shift_step s = sc::context_shift_step(c, 0, 4);
            REQUIRE(s.plan.n_past_after == 4 + (np - 4) - (np - 4) / 2);
            REQUIRE(s.contiguous);
            REQUIRE(s.kshift_ok);
            np = s.plan.n_past_after;
            ++shifts;
        }
        append(c, 0, np, 1, &rng);
        ++np;
        REQUIRE(c.seq_pos_max(0) == np - 1);
        REQUIRE(c.cells().seq_cell_count(0) == static_cast<std::uint32_t>(np));
    }
    CHECK(shifts > 30);
    CHECK(c.total_bytes() == bytes);
    CHECK(c.used() <= 32 + 8);
    CHECK(c.seq_pos_max(1) == 7);
}

TEST_CASE("Self-Extend step: kvcache::ops::self_extend; positions match a plain model and the closed form") {
    struct params {
        int ga_n, ga_w, n_tokens, batch;
    };
    for (const params& prm : {params{4, 8, 40, 1}, params{2, 8, 37, 1}, params{4, 16, 50, 1}, params{4, 8, 64, 8},
                              params{8, 64, 300, 5}, params{1, 8, 20, 3}}) {
        CAPTURE(prm.ga_n);
        CAPTURE(prm.ga_w);
        CAPTURE(prm.batch);
        demo::splitmix64 rng(static_cast<std::uint64_t>(prm.ga_n * 1000 + prm.ga_w));
        cache_t c(shape(512)), twin(shape(512));
        kvcache::ops::self_extend_state se{prm.ga_n, prm.ga_w, 0}, se_twin{prm.ga_n, prm.ga_w, 0};
        demo::k_shift_report worst;
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
        kvcache::pos_t n_past = 0, n_past_twin = 0;
        int added = 0;
        while (added < prm.n_tokens) {
            n_past = sc::self_extend_step(c, 0, se, n_past, worst);
            n_past_twin = kvcache::ops::self_extend(twin, 0, se_twin, n_past_twin).value();
            kvcache::ops::apply_k_shift(twin);
            model_loop();
            REQUIRE(n_past == m_past);
            REQUIRE(n_past_twin == n_past);
            REQUIRE(se.ga_i == m_ga_i);
            REQUIRE(se_twin.ga_i == se.ga_i);
            REQUIRE(same_cells(c, twin));
            const int n = std::min(prm.batch, prm.n_tokens - added);
            demo::splitmix64 r2 = rng;
            append(c, 0, n_past, n, &rng);
            append(twin, 0, n_past_twin, n, &r2);
            for (int i = 0; i < n; ++i) model.push_back(m_past + i);
            n_past += n;
            n_past_twin += n;
            m_past += n;
            added += n;
            std::map<kvcache::pos_t, std::uint32_t> from_model;
            for (auto p : model) ++from_model[p];
            REQUIRE(positions_of(c, 0) == from_model);
        }
        n_past = sc::self_extend_step(c, 0, se, n_past, worst);
        // The loop ran to completion: n_past is below the next window.
        if (prm.ga_n > 1) {
            CHECK(n_past < se.ga_i + prm.ga_w);
            CHECK(worst.n_moved > 0);
        }
        // Every move's K is a direct RoPE of the K before it.
        CHECK(worst.max_error <= 1e-5);
        // n_past formula.
        CHECK(n_past == prm.n_tokens - (prm.ga_n - 1) * se.ga_i);
        // Closed form for every token, compared with the cache's position multiset.
        std::map<kvcache::pos_t, std::uint32_t> want;
        for (int p = 0; p < prm.n_tokens; ++p) {
            REQUIRE(sc::self_extend_closed_form(se, p) == closed_form(prm.ga_n, se.ga_i, p));
            ++want[closed_form(prm.ga_n, se.ga_i, p)];
        }
        CHECK(positions_of(c, 0) == want);
        if (prm.ga_n == 1) CHECK(se.ga_i == 0);
    }
}

TEST_CASE("Self-Extend parameters are validated by the library; cache and state unchanged") {
    cache_t c(shape(64));
    append(c, 0, 0, 20);
    demo::k_shift_report worst;
    auto refused = [&](int ga_n, int ga_w, kvcache::pos_t n_past, const char* what) {
        kvcache::ops::self_extend_state st{ga_n, ga_w, 0};
        CHECK_THROWS_WITH_AS(sc::self_extend_step(c, 0, st, n_past, worst), doctest::Contains(what), kvcache::error);
        CHECK(st.ga_i == 0);
        CHECK_FALSE(c.has_shift());
        CHECK(c.seq_pos_max(0) == 19);
    };
    refused(0, 8, 20, "ga_n = 0");
    refused(4, 0, 20, "ga_w = 0");
    refused(4, 10, 20, "multiple of ga_n = 4");
    refused(4, 8, -1, "n_past = -1");
    CHECK(worst.n_moved == 0);
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
        demo::splitmix64 rng(seed);
        append(c, 0, 0, 40, &rng);
        const auto before = demo::snapshot_k(c, 0, 0, 64);
        CHECK(before.size() == 40);
        REQUIRE(kvcache::ops::context_shift(c, 0, 4));  // positions 22..39 move by -18
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

TEST_CASE("K-shift check: every RoPE variant of the shape (YaRN, llama3, LongRoPE, NTK, partial) is checked exactly") {
    std::vector<kvcache::rope_params> variants;
    kvcache::rope_params yarn;
    yarn.type = kvcache::rope_type::neox;
    yarn.scaling = kvcache::rope_scaling::yarn;
    yarn.freq_scale = 0.25f;
    yarn.n_ctx_orig = 32;
    yarn.attn_factor = kvcache::rope_params::yarn_mscale(4.0f);
    variants.push_back(yarn);
    kvcache::rope_params llama3;
    llama3.scaling = kvcache::rope_scaling::llama3;
    llama3.n_ctx_orig = 16;
    llama3.ntk_alpha = 2.0f;
    variants.push_back(llama3);
    kvcache::rope_params longrope;
    longrope.scaling = kvcache::rope_scaling::longrope;
    longrope.n_ctx_orig = 8;  // every key on the long side: moves stay exact
    longrope.n_rot = 6;
    longrope.short_factors = {1.0f, 1.5f, 2.0f};
    longrope.long_factors = {1.0f, 3.0f, 9.0f};
    variants.push_back(longrope);
    for (const kvcache::rope_params& rope : variants) {
        CAPTURE(static_cast<int>(rope.scaling));
        kvcache::model_shape sh = shape(64);
        sh.head_dim_k = 8;
        kvcache::model_shape plain_sh = sh;
        sh.rope = rope;
        cache_t c(sh), plain(plain_sh);
        demo::splitmix64 rng(5), rng2(5);
        append(c, 0, 10, 40, &rng);
        append(plain, 0, 10, 40, &rng2);
        const auto before = demo::snapshot_k(c, 0, 0, 64);
        const auto before_plain = demo::snapshot_k(plain, 0, 0, 64);
        for (cache_t* x : {&c, &plain}) {
            REQUIRE(x->seq_add(0, 30, -1, 1000));
            kvcache::ops::apply_k_shift(*x);
        }
        const demo::k_shift_report r = demo::check_k_shift(c, 0, before);
        CHECK(r.n_moved == 20);
        CHECK(r.max_error <= 1e-6);
        CHECK(demo::check_k_shift(plain, 0, before_plain).max_error <= 1e-6);
        // Not blind to the variant: the same K moved by the same delta differs from plain RoPE's.
        CHECK_FALSE(same_cells(c, plain));
    }
}

namespace {

/// The chunk-reuse scenario on a plain cache: [sys][old][doc] cached, [sys][doc][question]
/// requested; the library plans (chunk shifting, min_chunk 8) and applies the plan.
struct chunk_case {
    std::vector<kvcache::token_t> cached, request;
    kvcache::reuse::plan plan;
    std::vector<demo::k_snapshot> before;
    kvcache::pos_t src = 0;
};

chunk_case run_chunk_case(cache_t& c, bool doc_starts_like_old, bool rotate) {
    demo::splitmix64 rng(doc_starts_like_old ? 31 : 32);
    auto tokens = [&](int n, int base) {
        std::vector<kvcache::token_t> t(static_cast<std::size_t>(n));
        for (auto& x : t) x = base + static_cast<kvcache::token_t>(rng.next() % 50);
        return t;
    };
    const auto sys = tokens(10, 0), doc = tokens(60, 100), question = tokens(5, 200);
    auto old = tokens(30, 300);
    if (doc_starts_like_old) old[0] = doc[0];  // the stories260K case: the prefix grows by one
    chunk_case k;
    // (push_back, not insert: GCC 12's -Warray-bounds misfires on vector::insert here)
    auto add = [](std::vector<kvcache::token_t>& to, const std::vector<kvcache::token_t>& part) {
        for (kvcache::token_t t : part) to.push_back(t);
    };
    add(k.cached, sys);
    add(k.cached, old);
    add(k.cached, doc);
    add(k.request, sys);
    add(k.request, doc);
    add(k.request, question);
    append(c, 0, 0, static_cast<int>(k.cached.size()), &rng);
    k.src = static_cast<kvcache::pos_t>(sys.size() + old.size());
    k.before = demo::snapshot_k(c, 0, k.src, 64);
    kvcache::reuse::plan_options po;
    po.min_chunk = 8;
    k.plan = kvcache::reuse::make_plan(kvcache::prompt_tokens{std::span<const kvcache::token_t>(k.cached)},
                                       kvcache::prompt_tokens{std::span<const kvcache::token_t>(k.request)}, po);
    REQUIRE(kvcache::reuse::apply_plan(c, 0, k.plan));
    if (rotate)
        kvcache::ops::apply_k_shift(c);
    else
        c.clear_shifts();
    return k;
}

}  // namespace

TEST_CASE("chunk-reuse check: follows the plan, not a fixed offset") {
    for (bool like_old : {false, true}) {
        CAPTURE(like_old);
        kvcache::model_shape sh = shape(256);
        sh.n_head_kv = 2;
        sh.head_dim_k = 8;
        cache_t c(sh);
        const chunk_case k = run_chunk_case(c, like_old, true);
        REQUIRE(k.plan.moves.size() == 1);
        CHECK(k.plan.n_lcp == (like_old ? 11u : 10u));
        CHECK(k.plan.moves[0].src == k.src + (like_old ? 1 : 0));
        const sc::chunk_report r =
            sc::check_chunk_moves(c, 0, k.before, k.plan, k.cached, k.request);
        CHECK(r.ok());
        CHECK(r.positions_ok);
        CHECK(r.tokens_ok);
        CHECK(r.n_kept == (like_old ? 59u : 60u));
        CHECK(r.n_moved == r.n_kept);
        CHECK(r.kshift.max_error <= 1e-6);
        // The old check (every snapshotted cell moved by -old.size()) holds only without the
        // extra prefix token: with it, the document's first cell was dropped.
        bool fixed_offset = true;
        for (const demo::k_snapshot& s : k.before)
            fixed_offset = fixed_offset && !c.cells().is_free(s.cell) && c.cells().seqs(s.cell).test(0) &&
                           c.cells().pos(s.cell) == s.pos - 30;
        CHECK(fixed_offset == !like_old);
        // planned_pos: kept, moved, dropped.
        CHECK(sc::planned_pos(k.plan, 3) == 3);
        CHECK(sc::planned_pos(k.plan, k.plan.moves[0].src) == k.plan.moves[0].dst);
        CHECK_FALSE(sc::planned_pos(k.plan, k.src - 1).has_value());
    }
}

TEST_CASE("chunk-reuse check: a skipped K-shift, a wrong plan or wrong tokens fail it") {
    kvcache::model_shape sh = shape(256);
    sh.n_head_kv = 2;
    sh.head_dim_k = 8;
    {
        cache_t c(sh);
        const chunk_case k = run_chunk_case(c, false, false);
        const sc::chunk_report r = sc::check_chunk_moves(c, 0, k.before, k.plan, k.cached, k.request);
        CHECK(r.positions_ok);
        CHECK(r.kshift.max_error > 1e-2);
        CHECK_FALSE(r.ok());
    }
    {
        cache_t c(sh);
        const chunk_case k = run_chunk_case(c, false, true);
        kvcache::reuse::plan wrong = k.plan;
        wrong.moves[0].dst += 1;  // not where the library put the cells
        const sc::chunk_report r = sc::check_chunk_moves(c, 0, k.before, wrong, k.cached, k.request);
        CHECK_FALSE(r.positions_ok);
        CHECK_FALSE(r.tokens_ok);
        CHECK_FALSE(r.ok());
        std::vector<kvcache::token_t> other = k.request;
        other[static_cast<std::size_t>(k.plan.moves[0].dst) + 5] += 1;  // the request does not hold the chunk
        const sc::chunk_report t = sc::check_chunk_moves(c, 0, k.before, k.plan, k.cached, other);
        CHECK(t.positions_ok);
        CHECK_FALSE(t.tokens_ok);
        CHECK_FALSE(t.ok());
        // Nothing snapshotted: nothing moved, not a pass.
        CHECK_FALSE(sc::check_chunk_moves(c, 0, {}, k.plan, k.cached, k.request).ok());
    }
}
