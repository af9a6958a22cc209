// ops::attention against the float64 oracle (tests/reference/attention_ref.hpp).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "reference/attention_ref.hpp"
#include "support/random_normal.hpp"
#include "support/result_check.hpp"
#include "support/sanitized.hpp"
#include "kernels/kernel_test_util.hpp"

namespace {

using kvtest::block_cells;
using kvtest::layout_combo;
using kvtest::nmse;

using kvcache::pos_t;
using kvcache::seq_id_t;

struct scenario_cfg {
    std::uint32_t n_head_kv = 2, dk = 64, dv = 0, n_cells = 200, n_seq = 3, rounds = 30;
    std::uint32_t max_batch = 8;  // each placement round places 1..max_batch cells
    bool holes = true, shared = true;
    bool query_at_end = false;  // every query row in sequence 0, one past its last position (decode)
    kvcache::rope_type rope = kvcache::rope_type::normal;  // NeoX stores K rows in pair order
    std::uint32_t n_rot = 0;                               // 0: head_dim_k
};

// One sequence placed in order (no holes; its first 12 cells also copied to sequence 1),
// every query one past its end: a decode whose tiles are whole, so the fused loop and
// split-K run. Placed in rounds of 1..64 cells: each placement checkpoints the cell
// table, so 1..8-cell rounds filling ~12K cells spent most of the test's time there.
scenario_cfg tail_decode(std::uint32_t n_head_kv, std::uint32_t n_cells, std::uint32_t rounds) {
    scenario_cfg c;
    c.n_head_kv = n_head_kv;
    c.n_cells = n_cells;
    c.n_seq = 1;
    c.rounds = rounds;
    c.max_batch = 64;
    c.holes = false;
    c.query_at_end = true;
    return c;
}

kvcache::model_shape make_shape(const scenario_cfg& c) {
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = c.n_head_kv;
    s.head_dim_k = c.dk;
    s.head_dim_v = c.dv;
    s.n_cells = c.n_cells;
    s.n_seq_max = c.n_seq + 1;  // the last sequence stays empty unless seq_cp fills it
    s.rope.type = c.rope;
    s.rope.n_rot = c.n_rot;
    return s;
}

// Fills the cache the same way for the same seed whatever its element type: sequences
// interleaved in the cells, holes from seq_rm, shared cells from seq_cp, NaN in every
// free cell so that a kernel reading one arithmetically poisons the output. The twins
// (caches of the same layout, any element type) get the same operations and values in
// the same pass: check_case's f32 copy without drawing everything twice.
template <class Cache, class... Twins>
void build(Cache& cache, const scenario_cfg& c, std::uint32_t seed, Twins&... twins) {
    std::mt19937 rng(seed);
    kvtest::normal_floats nd;
    const auto& s = cache.shape();
    std::vector<pos_t> next(c.n_seq + 1, 0);
    auto place_some = [&](std::uint32_t rounds) {
        for (std::uint32_t r = 0; r < rounds; ++r) {
            const auto sq = static_cast<seq_id_t>(rng() % c.n_seq);
            const std::uint32_t n = std::min<std::uint32_t>(1 + rng() % c.max_batch, cache.capacity() - cache.used());
            if (n == 0) break;  // full
            std::vector<pos_t> pos(n);
            std::vector<seq_id_t> seq(n, sq);
            for (auto& p : pos) p = next[static_cast<std::size_t>(sq)]++;
            auto placed = cache.place(pos, seq);
            if (!placed.ok()) break;  // full (a paged layout also runs out of blocks)
            const auto& pl = placed.value();
            [[maybe_unused]] auto place_twin = [&](auto& t) {
                auto tp = t.place(pos, seq);
                REQUIRE(tp.ok());
                REQUIRE(tp.value().cells == pl.cells);
            };
            (place_twin(twins), ...);
            for (std::uint32_t l = 0; l < s.n_layer; ++l) {
                std::vector<float> k(n * s.k_row_size()), v(n * s.v_row_size());
                for (auto& x : k) x = nd(rng);
                for (auto& x : v) x = nd(rng);
                auto write = [&](auto& t) {
                    t.write_k(l, pl.cells, k.data());
                    t.write_v(l, pl.cells, v.data());
                };
                write(cache);
                (write(twins), ...);
            }
            static_cast<void>(cache.commit());
            (static_cast<void>(twins.commit()), ...);
        }
    };
    place_some(c.rounds);
    if (c.holes) {
        for (seq_id_t sq = 0; sq < static_cast<seq_id_t>(c.n_seq); ++sq) {
            const pos_t p0 = static_cast<pos_t>(rng() % 10);
            REQUIRE(cache.seq_rm(sq, p0, p0 + 3));
            [[maybe_unused]] auto rm_twin = [&](auto& t) { REQUIRE(t.seq_rm(sq, p0, p0 + 3)); };
            (rm_twin(twins), ...);
        }
        place_some(c.rounds / 3);
    }
    if (c.shared) {
        const auto dst = static_cast<seq_id_t>(c.n_seq);
        REQUIRE(cache.seq_cp(0, dst, 0, 12));
        [[maybe_unused]] auto cp_twin = [&](auto& t) { REQUIRE(t.seq_cp(0, dst, 0, 12)); };
        (cp_twin(twins), ...);
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    kvtest::fill_free_cells(cache, nan);
    (kvtest::fill_free_cells(twins, nan), ...);
}

struct query_set {
    std::vector<float> q;
    std::vector<pos_t> pos;
    std::vector<seq_id_t> seq;
};

query_set random_queries(std::mt19937& rng, std::uint32_t n_q, std::uint32_t n_head, std::uint32_t dk,
                         std::uint32_t n_seq, pos_t max_pos) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    query_set qs;
    qs.q.resize(std::size_t{n_q} * n_head * dk);
    for (auto& x : qs.q) x = nd(rng);
    for (std::uint32_t i = 0; i < n_q; ++i) {
        qs.seq.push_back(static_cast<seq_id_t>(rng() % (n_seq + 1)));
        qs.pos.push_back(static_cast<pos_t>(rng() % static_cast<std::uint32_t>(max_pos + 4)));
    }
    return qs;
}

template <class Cache>
void check_case(scenario_cfg c, std::uint32_t seed, std::uint32_t group, std::uint32_t n_q,
                kvcache::ops::attention_params p, double tol_self, double tol_f32) {
    constexpr std::uint32_t blk = block_cells<typename Cache::layout>;
    c.n_cells = (c.n_cells + blk - 1) / blk * blk;
    CAPTURE(seed);
    CAPTURE(c.n_head_kv);
    CAPTURE(c.dk);
    CAPTURE(c.dv);
    CAPTURE(c.n_cells);
    CAPTURE(static_cast<int>(c.rope));
    CAPTURE(c.n_rot);
    CAPTURE(group);
    CAPTURE(n_q);
    CAPTURE(p.window);
    CAPTURE(p.softcap);
    CAPTURE(p.n_threads);
    const auto shape = make_shape(c);
    Cache cache(shape);
    using f32_cache = kvcache::kv_cache<kvcache::f32, typename Cache::layout>;
    f32_cache exact(shape);
    build(cache, c, seed, exact);
    p.n_head = c.n_head_kv * group;
    std::mt19937 rng(seed ^ 0x9e3779b9u);
    pos_t max_pos = 0;
    for (seq_id_t s = 0; s <= static_cast<seq_id_t>(c.n_seq); ++s) max_pos = std::max(max_pos, cache.seq_pos_max(s));
    auto qs = random_queries(rng, n_q, p.n_head, shape.dim_k(), c.n_seq, max_pos);
    if (c.query_at_end) {
        std::fill(qs.seq.begin(), qs.seq.end(), seq_id_t{0});
        std::fill(qs.pos.begin(), qs.pos.end(), cache.seq_pos_max(0) + 1);
    }
    std::vector<float> out(std::size_t{n_q} * p.n_head * shape.dim_v(), -1.0f);
    kvcache::ops::attention_workspace ws;
    for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
        kvcache::ops::attention(cache, layer, qs.q.data(), qs.pos.data(), qs.seq.data(), n_q, p, out.data(), ws);
        for (float x : out) REQUIRE(std::isfinite(x));
        // Against the oracle on the stored (rounded) K/V: only the kernel's f32 arithmetic differs.
        const auto want = ref::attention(cache, layer, qs.q, qs.pos, qs.seq, p);
        CHECK(nmse(out, want) <= tol_self);
        // Against the oracle on unrounded f32 K/V: storage rounding included.
        const auto want32 = ref::attention(exact, layer, qs.q, qs.pos, qs.seq, p);
        CHECK(nmse(out, want32) <= tol_f32);
        // Rows with no visible cell are exactly zero.
        for (std::uint32_t i = 0; i < n_q; ++i) {
            bool visible = false;
            for (std::uint32_t cell = 0; cell < cache.n_window(); ++cell) {
                const pos_t pc = cache.cells().pos(cell);
                if (pc >= 0 && cache.cells().seqs(cell).test(qs.seq[i]) && pc <= qs.pos[i] &&
                    (p.window == 0 || std::int64_t{pc} > std::int64_t{qs.pos[i]} - p.window))
                    visible = true;
            }
            if (!visible)
                for (std::size_t k = 0; k < std::size_t{p.n_head} * shape.dim_v(); ++k)
                    CHECK(out[i * p.n_head * shape.dim_v() + k] == 0.0f);
        }
        // The scalar path agrees.
        auto ps = p;
        ps.path = kvcache::ops::kernel_path::scalar;
        std::vector<float> out_s(out.size());
        kvcache::ops::attention(cache, layer, qs.q.data(), qs.pos.data(), qs.seq.data(), n_q, ps, out_s.data(), ws);
        CHECK(nmse(out_s, want) <= tol_self);
        // The prefetch strategy changes speed only: every mode gives the automatic choice's bits.
        for (auto pm : {kvcache::ops::prefetch_mode::none, kvcache::ops::prefetch_mode::burst,
                        kvcache::ops::prefetch_mode::interleaved}) {
            auto pp = p;
            pp.prefetch = pm;
            std::vector<float> out_p(out.size(), -2.0f);
            kvcache::ops::attention(cache, layer, qs.q.data(), qs.pos.data(), qs.seq.data(), n_q, pp, out_p.data(), ws);
            CHECK(std::memcmp(out_p.data(), out.data(), out.size() * sizeof(float)) == 0);
        }
    }
}

template <class Element, kvcache::v_layout VL>
using combo = layout_combo<Element, kvcache::contiguous<VL>>;

}  // namespace

TEST_CASE_TEMPLATE("attention matches the float64 oracle over random shapes", C,
                   combo<kvcache::f32, kvcache::v_layout::row_major>, combo<kvcache::f16, kvcache::v_layout::row_major>,
                   combo<kvcache::bf16, kvcache::v_layout::row_major>,
                   combo<kvcache::f16, kvcache::v_layout::transposed>,
                   combo<kvcache::f32, kvcache::v_layout::transposed>, layout_combo<kvcache::f16, kvcache::paged<32>>) {
    const std::uint32_t base_seed = 20261122;
    MESSAGE("seed base ", base_seed);
    std::mt19937 rng(base_seed);
    const std::uint32_t dims[][2] = {{64, 0}, {16, 16}, {40, 24}, {128, 0}, {48, 72}, {8, 5}};
    const std::uint32_t groups[] = {1, 2, 4, 8};
    for (int it = 0; it < 12; ++it) {
        scenario_cfg c;
        c.n_head_kv = 1 + rng() % 3;
        c.dk = dims[it % 6][0];
        c.dv = dims[it % 6][1];
        c.n_cells = 17 + rng() % 300;  // rarely a multiple of any vector width
        c.n_seq = 1 + rng() % 4;
        c.rounds = 10 + rng() % 40;
        if (it % 2 == 1) {  // NeoX, full and partial rotary: q is permuted to K's row order
            c.rope = kvcache::rope_type::neox;
            c.n_rot = it % 4 == 1 ? 0 : c.dk / 2 / 2 * 2;
        }
        const std::uint32_t group = groups[it % 4];
        kvcache::ops::attention_params p;
        p.n_threads = 1 + static_cast<int>(rng() % 3);
        if (it % 3 == 1) p.window = 1 + static_cast<std::int32_t>(rng() % 20);
        if (it % 4 == 2) p.softcap = 5.0f;
        if (it % 5 == 3) p.scale = 0.3f;
        const std::uint32_t n_q = 1 + rng() % 40;
        check_case<typename C::cache>(c, rng(), group, n_q, p, 1e-10, C::tol_f32);
    }
}

TEST_CASE_TEMPLATE("attention decode with split-K matches the oracle", C,
                   combo<kvcache::f32, kvcache::v_layout::row_major>, combo<kvcache::f16, kvcache::v_layout::row_major>,
                   layout_combo<kvcache::f16, kvcache::paged<64>>) {
    for (int threads : {1, 2, 3, 8}) {
        scenario_cfg c;
        c.n_head_kv = 1;
        c.dk = 128;
        c.n_cells = 1500;
        c.n_seq = 1;
        c.rounds = 300;
        if (threads % 2 == 1) c.rope = kvcache::rope_type::neox;
        kvcache::ops::attention_params p;
        p.n_threads = threads;
        check_case<typename C::cache>(c, 777u + static_cast<std::uint32_t>(threads), 4, 1, p, 1e-10, C::tol_f32);
        p.window = 100;
        check_case<typename C::cache>(c, 778u, 4, 1, p, 1e-10, C::tol_f32);
    }
}

TEST_CASE_TEMPLATE("attention decode split finely over long contexts matches the oracle", C,
                   combo<kvcache::f32, kvcache::v_layout::row_major>, combo<kvcache::f16, kvcache::v_layout::row_major>) {
    // 4 KV heads on 2 threads: 2 parts per head by the 4-items-per-thread rule, 3 by the
    // finer one (parts of >= 4096 of the ~12.3K cells), so the merge sees an odd count.
    // Under AddressSanitizer (about 5x slower) only the 2-thread case, which has both.
    for (int threads : {2, 3}) {
        if (kvtest::sanitized && threads == 3) continue;
        const scenario_cfg c = tail_decode(4, 12300, 400);
        kvcache::ops::attention_params p;
        p.n_threads = threads;
        check_case<typename C::cache>(c, 4242u + static_cast<std::uint32_t>(threads), 4, 1, p, 1e-10, C::tol_f32);
    }
}

TEST_CASE_TEMPLATE("attention decode with K and V heads of different sizes matches the oracle", C,
                   combo<kvcache::f32, kvcache::v_layout::row_major>, combo<kvcache::f16, kvcache::v_layout::row_major>) {
    // The fused decode loop pairs dk K rows with ceil(dv / 64) * 32 V pieces per tile
    // (pieces of up to 64 dimensions of one cell; a narrower last block when 64 does not
    // divide dv): a fixed 1 or 2 K rows per piece ({64, 128}; {128, 128} elsewhere), or
    // the general pairing (more K rows per V piece, or fewer) with last blocks of 16, 32
    // and 48 dimensions.
    const std::uint32_t dims[][2] = {{64, 128}, {128, 64}, {40, 32}, {96, 160}, {112, 112}, {24, 16}};
    for (const auto& dd : dims)
        for (std::uint32_t group : {1u, 2u, 4u}) {
            scenario_cfg c = tail_decode(2, 700, 17);
            c.dk = dd[0];
            c.dv = dd[1];
            kvcache::ops::attention_params p;
            p.n_threads = 1 + static_cast<int>(group % 2);
            check_case<typename C::cache>(c, 91u + dd[0] + group, group, 1, p, 1e-10, C::tol_f32);
        }
}

TEST_CASE("attention: a query that sees nothing gets zeros, never NaN") {
    scenario_cfg c;
    c.n_seq = 2;
    c.shared = false;
    const auto shape = make_shape(c);
    kvcache::kv_cache<kvcache::f16> cache(shape);
    build(cache, c, 5);
    kvcache::ops::attention_params p;
    p.n_head = shape.n_head_kv * 2;
    std::vector<float> q(std::size_t{3} * p.n_head * shape.dim_k(), 1.0f), out(std::size_t{3} * p.n_head * shape.dim_v(), 7.0f);
    // Sequence 2 (empty), a position below every cell of sequence 0 (after seq_rm of [0, 3) ...),
    // and a window that hides everything.
    std::vector<pos_t> pos = {5, 0, 1000000};
    std::vector<seq_id_t> seq = {2, 1, 0};
    REQUIRE(cache.seq_rm(1, 0, 1));
    p.window = 1;
    kvcache::ops::attention_workspace ws;
    kvcache::ops::attention(cache, 0, q.data(), pos.data(), seq.data(), 3, p, out.data(), ws);
    for (float x : out) CHECK(x == 0.0f);
    // Empty cache.
    kvcache::kv_cache<kvcache::f32> empty(shape);
    kvcache::ops::attention(empty, 0, q.data(), pos.data(), seq.data(), 3, p, out.data(), ws);
    for (float x : out) CHECK(x == 0.0f);
}

TEST_CASE("attention: bad arguments throw and write nothing") {
    scenario_cfg c;
    const auto shape = make_shape(c);
    kvcache::kv_cache<kvcache::f32> cache(shape);
    build(cache, c, 9);
    kvcache::ops::attention_params p;
    p.n_head = shape.n_head_kv;
    std::vector<float> q(std::size_t{p.n_head} * shape.dim_k(), 1.0f), out(std::size_t{p.n_head} * shape.dim_v(), 7.0f);
    pos_t pos = 3;
    seq_id_t seq = 0;
    kvcache::ops::attention_workspace ws;
    auto expect_throw = [&](kvcache::ops::attention_params pp, std::uint32_t layer, const float* qq, const pos_t* qp,
                            const seq_id_t* qsq, float* o, const char* what) {
        CAPTURE(what);
        try {
            kvcache::ops::attention(cache, layer, qq, qp, qsq, 1, pp, o, ws);
            FAIL("no exception");
        } catch (const kvcache::error& e) {
            CHECK(e.code() == kvcache::errc::invalid_argument);
            CHECK(std::string(e.what()).find(what) != std::string::npos);
        }
        for (float x : out) CHECK(x == 7.0f);
    };
    expect_throw(p, 2, q.data(), &pos, &seq, out.data(), "layer = 2");
    auto bad = p;
    bad.n_head = 3;
    expect_throw(bad, 0, q.data(), &pos, &seq, out.data(), "n_head = 3");
    bad = p;
    bad.n_head = 0;
    expect_throw(bad, 0, q.data(), &pos, &seq, out.data(), "n_head = 0");
    bad = p;
    bad.scale = -1.0f;
    expect_throw(bad, 0, q.data(), &pos, &seq, out.data(), "scale");
    bad = p;
    bad.scale = std::numeric_limits<float>::infinity();
    expect_throw(bad, 0, q.data(), &pos, &seq, out.data(), "scale");
    bad = p;
    bad.window = -2;
    expect_throw(bad, 0, q.data(), &pos, &seq, out.data(), "window = -2");
    bad = p;
    bad.softcap = std::numeric_limits<float>::quiet_NaN();
    expect_throw(bad, 0, q.data(), &pos, &seq, out.data(), "softcap");
    expect_throw(p, 0, nullptr, &pos, &seq, out.data(), "q is null");
    expect_throw(p, 0, q.data(), nullptr, &seq, out.data(), "q_pos is null");
    expect_throw(p, 0, q.data(), &pos, nullptr, out.data(), "q_seq is null");
    seq_id_t bad_seq = 99;
    expect_throw(p, 0, q.data(), &pos, &bad_seq, out.data(), "q_seq[0] = 99");
    pos_t bad_pos = -1;
    expect_throw(p, 0, q.data(), &bad_pos, &seq, out.data(), "q_pos[0] = -1");
    try {
        kvcache::ops::attention(cache, 0, q.data(), &pos, &seq, 1, p, nullptr, ws);
        FAIL("no exception");
    } catch (const kvcache::error& e) {
        CHECK(std::string(e.what()).find("out is null") != std::string::npos);
    }
}

// Many query rows over a cache whose KV head exceeds 512 KiB: the kernel runs 16 slots
// per item over single tiles (ops::attention's choice); smaller caches above run 8 slots
// over blocks of two tiles. Both must match the oracle.
TEST_CASE_TEMPLATE("attention prefill over a long cache matches the oracle", C,
                   combo<kvcache::f32, kvcache::v_layout::row_major>, combo<kvcache::f16, kvcache::v_layout::transposed>) {
    scenario_cfg c;
    c.n_head_kv = 1;
    c.dk = 128;
    c.n_cells = 2100;
    c.n_seq = 2;
    c.rounds = 420;  // ~1900 cells in use: n_window x 256 dims x 2 or 4 bytes > 512 KiB
    kvcache::ops::attention_params p;
    p.n_threads = 2;
    check_case<typename C::cache>(c, 4242u, 4, 12, p, 1e-10, C::tol_f32);
    p.window = 300;
    p.softcap = 8.0f;
    check_case<typename C::cache>(c, 4243u, 2, 9, p, 1e-10, C::tol_f32);
}

// The workspace keeps its per-tile summaries while the cells stay unchanged (the layers
// of one decode step) and must rebuild them after any change: a workspace reused across
// every kind of cell change gives the bits a fresh workspace gives, and both match the
// oracle. One workspace also alternates between two caches.
TEST_CASE("attention: a reused workspace follows every change of the cells") {
    using cache_t = kvcache::kv_cache<kvcache::f32>;
    scenario_cfg c;
    c.n_cells = 300;
    c.rounds = 25;
    const auto shape = make_shape(c);
    cache_t cache(shape), other(shape);
    build(cache, c, 77u);
    build(other, c, 78u);
    kvcache::ops::attention_params p;
    p.n_head = c.n_head_kv * 2;
    kvcache::ops::attention_workspace reused;
    std::mt19937 rng(79u);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<pos_t> next(c.n_seq + 1, 0);
    for (seq_id_t s = 0; s <= static_cast<seq_id_t>(c.n_seq); ++s) next[static_cast<std::size_t>(s)] = cache.seq_pos_max(s) + 1;

    auto check_same = [&](const cache_t& cc, int threads, const char* what) {
        CAPTURE(what);
        CAPTURE(threads);
        p.n_threads = threads;
        pos_t max_pos = 0;
        for (seq_id_t s = 0; s <= static_cast<seq_id_t>(c.n_seq); ++s) max_pos = std::max(max_pos, cc.seq_pos_max(s));
        const auto qs = random_queries(rng, 5, p.n_head, shape.dim_k(), c.n_seq, max_pos);
        for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
            std::vector<float> got(std::size_t{5} * p.n_head * shape.dim_v()), want(got.size());
            kvcache::ops::attention(cc, layer, qs.q.data(), qs.pos.data(), qs.seq.data(), 5, p, got.data(), reused);
            kvcache::ops::attention_workspace fresh;
            kvcache::ops::attention(cc, layer, qs.q.data(), qs.pos.data(), qs.seq.data(), 5, p, want.data(), fresh);
            CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
            CHECK(nmse(got, ref::attention(cc, layer, qs.q, qs.pos, qs.seq, p)) <= 1e-10);
        }
    };
    auto place = [&](seq_id_t sq, std::uint32_t n, bool keep) -> bool {
        if (n > cache.capacity() - cache.used()) return false;
        std::vector<pos_t> pos(n);
        std::vector<seq_id_t> seq(n, sq);
        for (auto& x : pos) x = next[static_cast<std::size_t>(sq)]++;
        auto placed = cache.place(pos, seq);
        REQUIRE(placed.ok());
        for (std::uint32_t l = 0; l < shape.n_layer; ++l) {
            std::vector<float> k(n * shape.k_row_size()), v(n * shape.v_row_size());
            for (auto& x : k) x = nd(rng);
            for (auto& x : v) x = nd(rng);
            cache.write_k(l, placed.value().cells, k.data());
            cache.write_v(l, placed.value().cells, v.data());
        }
        if (keep) {
            static_cast<void>(cache.commit());
        } else {
            static_cast<void>(cache.restore());
            next[static_cast<std::size_t>(sq)] -= static_cast<pos_t>(n);
        }
        return true;
    };

    check_same(cache, 1, "start");
    for (int step = 0; step < 40; ++step) {
        const auto sq = static_cast<seq_id_t>(rng() % c.n_seq);
        const pos_t top = std::max<pos_t>(1, next[static_cast<std::size_t>(sq)]);
        const pos_t a = static_cast<pos_t>(rng() % static_cast<std::uint32_t>(top));
        const char* what = "";
        const std::uint64_t before = cache.cells().stamp();
        bool changes = false;
        try {  // (seq_cp / seq_add may refuse: dst holds a position (throws), no free cell for a split (a
             // result, thrown here by value()))
        switch (step % 8) {
            case 0: what = "place + commit"; changes = place(sq, 1 + rng() % 6, true); break;
            case 1: what = "place + restore"; static_cast<void>(place(sq, 1 + rng() % 6, false)); break;
            case 2: what = "seq_rm"; cache.seq_rm(sq, a, a + 4).value(); break;
            case 3: what = "seq_cp"; cache.seq_cp(sq, static_cast<seq_id_t>(c.n_seq), a, -1).value(); break;
            case 4: what = "seq_add"; cache.seq_add(sq, a, -1, 3).value(); next[static_cast<std::size_t>(sq)] += 3; break;
            case 5: what = "seq_div"; cache.seq_div(sq, a, -1, 2).value(); break;
            case 6: what = "seq_keep"; if (step % 16 == 14) cache.seq_keep(sq); break;
            default: what = "clear + refill"; if (step % 24 == 23) { cache.clear(); std::fill(next.begin(), next.end(), 0); } changes = place(sq, 8, true); break;
        }
        } catch (const kvcache::error&) {
            // refused, nothing changed (the cache's own tests check that)
        }
        if (changes) CHECK(cache.cells().stamp() != before);
        if (cache.has_shift()) kvcache::ops::apply_k_shift(cache);  // (attention refuses pending shifts)
        check_same(cache, step % 3 == 0 ? 2 : 1, what);
        if (step % 5 == 0) check_same(other, 1, "the other cache");
    }
    const std::uint64_t s0 = cache.cells().stamp();
    check_same(cache, 2, "attention alone");
    CHECK(cache.cells().stamp() == s0);  // reading never changes the stamp
}

TEST_CASE("prefetch_mode::automatic: interleaved for decode-shaped items of calls over more than 1 MiB of K/V (or on Intel)") {
    using kvcache::ops::prefetch_mode;
    using kvcache::ops::detail_attn::resolve_prefetch;
    constexpr std::size_t mib = std::size_t{1} << 20;
    for (auto m : {prefetch_mode::none, prefetch_mode::burst, prefetch_mode::interleaved}) {
        CHECK(resolve_prefetch(m, 4, 64 * mib) == m);  // explicit choices pass through
        CHECK(resolve_prefetch(m, 16, 1024) == m);
    }
    const bool intel = kvcache::cpu_is_intel();
    CHECK(resolve_prefetch(prefetch_mode::automatic, 4, 64 * mib) == prefetch_mode::interleaved);
    CHECK(resolve_prefetch(prefetch_mode::automatic, 8, mib + 1) == prefetch_mode::interleaved);
    const prefetch_mode other = intel ? prefetch_mode::interleaved : prefetch_mode::none;
    CHECK(resolve_prefetch(prefetch_mode::automatic, 4, mib) == other);        // fits in one core's L2
    CHECK(resolve_prefetch(prefetch_mode::automatic, 16, 64 * mib) == other);  // prefill: compute-bound
}

TEST_CASE("set_prefetch: each item of a call gets the mode resolve_prefetch gives for its own slots") {
    using kvcache::ops::prefetch_mode;
    using kvcache::ops::detail_attn::set_prefetch;
    constexpr std::size_t mib = std::size_t{1} << 20;
    kvcache::kernels::attn_shape sh;
    // Explicit modes apply to every item, whatever its slots.
    for (auto m : {prefetch_mode::none, prefetch_mode::burst, prefetch_mode::interleaved}) {
        set_prefetch(sh, m, 64 * mib);
        CHECK(sh.burst_prefetch == (m == prefetch_mode::burst));
        CHECK(sh.interleaved_prefetch == (m == prefetch_mode::interleaved));
        CHECK(sh.prefetch_max_slots == 16);
    }
    // automatic over a large call (decode rows beside a prefill chunk): decode-shaped items
    // (<= 8 slots) interleave; 16-slot items do too on Intel only.
    set_prefetch(sh, prefetch_mode::automatic, 64 * mib);
    CHECK_FALSE(sh.burst_prefetch);
    CHECK(sh.interleaved_prefetch);
    CHECK(sh.prefetch_max_slots == (kvcache::cpu_is_intel() ? 16u : 8u));
    // automatic over a small call: nothing to prefetch off Intel.
    set_prefetch(sh, prefetch_mode::automatic, mib);
    CHECK(sh.interleaved_prefetch == kvcache::cpu_is_intel());
}

TEST_CASE("tile_ahead: the prefetch target walks the tile ranges in visiting order, across ranges") {
    using kvcache::kernels::tile_ahead;
    using kvcache::kernels::tile_range;
    std::mt19937 rng(11);
    for (int round = 0; round < 300; ++round) {
        // Random ranges (some empty, some adjacent, some one tile long: a paged block table).
        std::vector<tile_range> ranges(1 + rng() % 6);
        std::uint32_t at = rng() % 4;
        for (auto& r : ranges) {
            at += rng() % 3;
            r = {at, at + static_cast<std::uint32_t>(rng() % 4)};
            at = r.t1;
        }
        std::vector<std::pair<std::size_t, std::uint32_t>> order;  // (range, tile) as the kernel visits them
        for (std::size_t i = 0; i < ranges.size(); ++i)
            for (std::uint32_t t = ranges[i].t0; t < ranges[i].t1; ++t) order.emplace_back(i, t);
        for (std::size_t k = 0; k < order.size(); ++k)
            for (std::uint32_t ahead = 0; ahead < 6; ++ahead) {
                const std::uint32_t want = k + ahead < order.size() ? order[k + ahead].second : order[k].second;
                CHECK(tile_ahead(ranges.data(), ranges.size(), order[k].first, order[k].second, ahead) == want);
            }
    }
    const tile_range one{5, 9};
    CHECK(tile_ahead(&one, 1, 0, 5) == 5 + kvcache::kernels::prefetch_tiles);  // the default distance
}
