// ops::attention with many sequences per call (issue 26): multi-sequence decode, mixed
// prefill + decode (continuous batching), against the float64 oracle; bit-identity of a
// row's output whatever else is in the call and however many threads run it; the
// pending-K-shift refusal (issue 25).
// (In tests/kernels/ so that it also runs in the -march=native build, where the fused
// decode loop exists.)
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reference/attention_ref.hpp"
#include "support/random_normal.hpp"
#include "support/result_check.hpp"
#include "kernels/kernel_test_util.hpp"

namespace {

using kvtest::block_cells;
using kvtest::layout_combo;
using kvtest::nmse;

using kvcache::pos_t;
using kvcache::seq_id_t;
namespace ops = kvcache::ops;

struct multi_cfg {
    std::uint32_t n_head_kv = 2, dk = 64, dv = 0;
    std::uint32_t n_cells = 1024;  // rounded up to the layout's block size
    std::uint32_t n_seq = 5;       // sequences 0 .. n_seq-1; sequence n_seq stays empty
    std::uint32_t prefix = 300;    // sequence 0's first cells, placed before anything else
    std::uint32_t fork = 100;      // sequence 1 = seq_cp of sequence 0's first `fork` positions
    std::uint32_t rounds = 60;     // then interleaved appends of 1-8 tokens to random sequences
};


template <class Cache>
kvcache::model_shape make_shape(multi_cfg c) {
    constexpr std::uint32_t blk = block_cells<typename Cache::layout>;
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = c.n_head_kv;
    s.head_dim_k = c.dk;
    s.head_dim_v = c.dv;
    s.n_cells = (c.n_cells + blk - 1) / blk * blk;
    s.n_seq_max = c.n_seq + 1;
    return s;
}

// A long sequence 0, a fork of its first cells (seq_cp), interleaved appends to every
// sequence (tiles that mix sequences), a hole per sequence, NaN in every free cell.
template <class Cache>
void build(Cache& cache, const multi_cfg& c, std::uint32_t seed) {
    std::mt19937 rng(seed);
    kvtest::normal_floats nd;
    const auto& s = cache.shape();
    std::vector<pos_t> next(c.n_seq + 1, 0);
    auto append = [&](seq_id_t sq, std::uint32_t n) {
        if (n > cache.capacity() - cache.used()) return false;
        std::vector<pos_t> pos(n);
        std::vector<seq_id_t> seq(n, sq);
        for (auto& p : pos) p = next[static_cast<std::size_t>(sq)]++;
        auto placed = cache.place(pos, seq);
        if (!placed.ok()) return false;
        const auto& pl = placed.value();
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            std::vector<float> k(n * s.k_row_size()), v(n * s.v_row_size());
            for (auto& x : k) x = nd(rng);
            for (auto& x : v) x = nd(rng);
            cache.write_k(l, pl.cells, k.data());
            cache.write_v(l, pl.cells, v.data());
        }
        static_cast<void>(cache.commit());
        return true;
    };
    for (std::uint32_t done = 0; done < c.prefix;) {
        const std::uint32_t n = std::min<std::uint32_t>(64, c.prefix - done);
        REQUIRE(append(0, n));
        done += n;
    }
    if (c.n_seq > 1 && c.fork > 0) {
        REQUIRE(cache.seq_cp(0, 1, 0, static_cast<pos_t>(c.fork)));
        next[1] = static_cast<pos_t>(c.fork);
    }
    for (std::uint32_t r = 0; r < c.rounds; ++r)
        if (!append(static_cast<seq_id_t>(rng() % c.n_seq), 1 + rng() % 8)) break;
    for (seq_id_t sq = 0; sq < static_cast<seq_id_t>(c.n_seq); ++sq) {
        const pos_t p0 = 3 + static_cast<pos_t>(rng() % 20);
        REQUIRE(cache.seq_rm(sq, p0, p0 + 2));
    }
    kvtest::fill_free_cells(cache, std::numeric_limits<float>::quiet_NaN());
}

struct rows {
    std::vector<float> q;
    std::vector<pos_t> pos;
    std::vector<seq_id_t> seq;
    [[nodiscard]] std::uint32_t size() const { return static_cast<std::uint32_t>(pos.size()); }
};

// A continuous-batching call: a prefill chunk of `chunk` rows of sequence 0 (its last
// positions), one decode row (one past the end) for every other sequence, the empty
// sequence, and a few random rows; row order shuffled so sequences interleave.
template <class Cache>
rows make_rows(const Cache& cache, const multi_cfg& c, std::uint32_t n_head, std::uint32_t chunk, std::mt19937& rng) {
    rows r;
    const pos_t end0 = cache.seq_pos_max(0);
    for (std::uint32_t i = 0; i < chunk; ++i) {
        r.pos.push_back(end0 - static_cast<pos_t>(chunk) + 1 + static_cast<pos_t>(i));
        r.seq.push_back(0);
    }
    for (seq_id_t sq = 1; sq <= static_cast<seq_id_t>(c.n_seq); ++sq) {
        r.pos.push_back(std::max<pos_t>(0, cache.seq_pos_max(sq) + 1));
        r.seq.push_back(sq);
    }
    for (int i = 0; i < 3; ++i) {
        const auto sq = static_cast<seq_id_t>(rng() % c.n_seq);
        r.seq.push_back(sq);
        r.pos.push_back(static_cast<pos_t>(rng() % static_cast<std::uint32_t>(cache.seq_pos_max(sq) + 2)));
    }
    std::vector<std::size_t> perm(r.pos.size());
    for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    rows o;
    for (std::size_t i : perm) {
        o.pos.push_back(r.pos[i]);
        o.seq.push_back(r.seq[i]);
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    o.q.resize(std::size_t{o.size()} * n_head * cache.shape().dim_k());
    for (auto& x : o.q) x = nd(rng);
    return o;
}

// Rows `pick` of r (in that order).
rows subset(const rows& r, const std::vector<std::uint32_t>& pick, std::size_t row_q) {
    rows o;
    for (std::uint32_t i : pick) {
        o.pos.push_back(r.pos[i]);
        o.seq.push_back(r.seq[i]);
        o.q.insert(o.q.end(), r.q.begin() + static_cast<std::ptrdiff_t>(i * row_q),
                   r.q.begin() + static_cast<std::ptrdiff_t>((i + 1) * row_q));
    }
    return o;
}


template <class Cache>
std::vector<float> run(const Cache& cache, std::uint32_t layer, const rows& r, const ops::attention_params& p,
                       ops::attention_workspace& ws) {
    std::vector<float> out(std::size_t{r.size()} * p.n_head * cache.shape().dim_v(), -7.0f);
    ops::attention(cache, layer, r.q.data(), r.pos.data(), r.seq.data(), r.size(), p, out.data(), ws);
    return out;
}

bool same_bits(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// The checks of one call: oracle, per-sequence and per-row bit-identity, thread counts.
template <class Cache>
void check_call(const Cache& cache, const rows& r, ops::attention_params p) {
    const auto& shape = cache.shape();
    const std::size_t row_q = std::size_t{p.n_head} * shape.dim_k(), row_o = std::size_t{p.n_head} * shape.dim_v();
    ops::attention_workspace ws;
    for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
        CAPTURE(layer);
        p.n_threads = 2;
        const auto out = run(cache, layer, r, p, ws);
        for (float x : out) REQUIRE(std::isfinite(x));
        const auto want = ref::attention(cache, layer, r.q, r.pos, r.seq, p);
        CHECK(nmse(out, want) <= 1e-10);
        // Row by row too: a small row must not hide in the whole call's error.
        for (std::uint32_t i = 0; i < r.size(); ++i) {
            std::vector<float> got(out.begin() + static_cast<std::ptrdiff_t>(i * row_o),
                                   out.begin() + static_cast<std::ptrdiff_t>((i + 1) * row_o));
            std::vector<double> w(want.begin() + static_cast<std::ptrdiff_t>(i * row_o),
                                  want.begin() + static_cast<std::ptrdiff_t>((i + 1) * row_o));
            CHECK(nmse(got, w) <= 1e-9);
        }
        if (!p.deterministic) continue;
        // Threads: 1, 3 and the default give the same bits as 2.
        for (int th : {1, 3, 0}) {
            auto pt = p;
            pt.n_threads = th;
            const auto o = run(cache, layer, r, pt, ws);
            CHECK_MESSAGE(same_bits(o.data(), out.data(), out.size()), "threads ", th);
        }
        // A call holding only one sequence's rows, and a call holding one row alone: the
        // same bits for every row.
        for (seq_id_t sq = 0; sq < static_cast<seq_id_t>(shape.n_seq_max); ++sq) {
            std::vector<std::uint32_t> pick;
            for (std::uint32_t i = 0; i < r.size(); ++i)
                if (r.seq[i] == sq) pick.push_back(i);
            if (pick.empty()) continue;
            auto p1 = p;
            p1.n_threads = 1 + static_cast<int>(sq % 2);
            const auto o = run(cache, layer, subset(r, pick, row_q), p1, ws);
            for (std::size_t k = 0; k < pick.size(); ++k)
                CHECK_MESSAGE(same_bits(o.data() + k * row_o, out.data() + pick[k] * row_o, row_o),
                              "sequence ", sq, " row ", pick[k]);
        }
        for (std::uint32_t i = 0; i < r.size(); i += 3) {
            const auto o = run(cache, layer, subset(r, {i}, row_q), p, ws);
            CHECK_MESSAGE(same_bits(o.data(), out.data() + i * row_o, row_o), "row ", i, " alone");
        }
    }
}

// The whole check for one cache type and configuration.
template <class Cache>
void check_multi(const multi_cfg& c, std::uint32_t group, std::uint32_t chunk, ops::attention_params p,
                 std::uint32_t seed) {
    CAPTURE(seed);
    CAPTURE(c.n_head_kv);
    CAPTURE(c.dk);
    CAPTURE(c.dv);
    CAPTURE(group);
    CAPTURE(chunk);
    CAPTURE(p.window);
    CAPTURE(p.deterministic);
    const auto shape = make_shape<Cache>(c);
    Cache cache(shape);
    build(cache, c, seed);
    p.n_head = c.n_head_kv * group;
    std::mt19937 rng(seed * 7u + 1u);
    const rows r = make_rows(cache, c, p.n_head, chunk, rng);
    check_call(cache, r, p);
}
using row_major = kvcache::contiguous<kvcache::v_layout::row_major>;
using transposed = kvcache::contiguous<kvcache::v_layout::transposed>;
using paged_rm = kvcache::paged<32, kvcache::v_layout::row_major>;
using paged_t = kvcache::paged<64, kvcache::v_layout::transposed>;

}  // namespace

TEST_CASE_TEMPLATE("attention multi-sequence and mixed calls match the oracle; rows are bit-identical alone", C,
                   layout_combo<kvcache::f32, row_major>, layout_combo<kvcache::f16, row_major>, layout_combo<kvcache::bf16, row_major>,
                   layout_combo<kvcache::f16, transposed>, layout_combo<kvcache::f32, paged_rm>, layout_combo<kvcache::f16, paged_rm>,
                   layout_combo<kvcache::bf16, paged_t>, layout_combo<kvcache::f16, paged_t>) {
    std::uint32_t seed = 2026112600u;
    // (group, prefill chunk, window, dk, dv): GQA 1/4/8, decode-only and mixed calls,
    // sliding windows, K and V heads of other sizes.
    struct shape_case {
        std::uint32_t group, chunk;
        std::int32_t window;
        std::uint32_t dk, dv;
    };
    for (const shape_case sc : {shape_case{4, 0, 0, 64, 0}, shape_case{4, 37, 0, 128, 0}, shape_case{1, 20, 0, 64, 0},
                                shape_case{8, 5, 50, 48, 72}, shape_case{2, 70, 9, 64, 0}}) {
        multi_cfg c;
        c.dk = sc.dk;
        c.dv = sc.dv;
        ops::attention_params p;
        p.window = sc.window;
        check_multi<typename C::cache>(c, sc.group, sc.chunk, p, seed++);
    }
    // Non-deterministic mode: still exact to the oracle.
    multi_cfg c;
    ops::attention_params p;
    p.deterministic = false;
    check_multi<typename C::cache>(c, 4, 30, p, seed++);
}

TEST_CASE_TEMPLATE("attention: long sequences cut into split-K parts stay bit-identical across threads and calls", C,
                   layout_combo<kvcache::f16, row_major>, layout_combo<kvcache::f32, paged_rm>) {
    // Sequence 0 holds ~9K cells (2 parts of >= 4096 cells in deterministic mode), its
    // fork 3K; a 16-row chunk of sequence 0 next to decode rows.
    multi_cfg c;
    c.n_head_kv = 2;
    c.n_cells = 13000;
    c.n_seq = 3;
    c.prefix = 9000;
    c.fork = 3000;
    c.rounds = 200;
    ops::attention_params p;
    check_multi<typename C::cache>(c, 4, 16, p, 99u);
    p.window = 5000;
    check_multi<typename C::cache>(c, 2, 3, p, 98u);
}

TEST_CASE("attention refuses a cache with pending K-shifts, writes nothing, and works after apply_k_shift") {
    using cache_t = kvcache::kv_cache<kvcache::f16>;
    multi_cfg c;
    c.n_seq = 2;
    const auto shape = make_shape<cache_t>(c);
    cache_t cache(shape);
    build(cache, c, 5u);
    ops::attention_params p;
    p.n_head = c.n_head_kv * 4;
    std::mt19937 rng(3u);
    const rows r = make_rows(cache, c, p.n_head, 4, rng);
    ops::attention_workspace ws;
    const auto before = run(cache, 0, r, p, ws);
    REQUIRE(cache.seq_add(1, 0, -1, 5));  // sequence 1 moves: its K is rotated for the old positions
    REQUIRE(cache.has_shift());
    std::vector<float> out(before.size(), -7.0f);
    const auto got = kvtest::run_refusal([&] {
        ops::attention(cache, 0, r.q.data(), r.pos.data(), r.seq.data(), r.size(), p, out.data(), ws);
    });
    CHECK(got.kind == kvtest::refusal_kind::thrown);
    CHECK(got.code == kvcache::errc::invalid_argument);
    CHECK(got.message.find("apply_k_shift") != std::string::npos);
    for (float x : out) CHECK(x == -7.0f);
    // The scalar path refuses too; so does a call that names only the unshifted sequence
    // (the rule is on the cache, checked in O(1)).
    auto ps = p;
    ps.path = ops::kernel_path::scalar;
    CHECK_THROWS_AS(ops::attention(cache, 0, r.q.data(), r.pos.data(), r.seq.data(), r.size(), ps, out.data(), ws),
                    kvcache::error);
    const seq_id_t s0 = 0;
    const pos_t p0 = 5;
    CHECK_THROWS_AS(ops::attention(cache, 0, r.q.data(), &p0, &s0, 1, p, out.data(), ws), kvcache::error);
    ops::apply_k_shift(cache);
    REQUIRE_FALSE(cache.has_shift());
    const auto after = run(cache, 0, r, p, ws);
    CHECK(nmse(after, ref::attention(cache, 0, r.q, r.pos, r.seq, p)) <= 1e-10);
}

// ---------------------------------------------------------------- shared prefixes (cascade)

namespace {

struct shared_cfg {
    std::uint32_t n_head_kv = 2, dk = 64;
    std::uint32_t prefix = 1100;  // sequence 0's prefix (>= 1024 cells: a cascade class), then seq_cp
    std::uint32_t n_fork = 6;     // sequences 0 .. n_fork-1 share the prefix
    std::uint32_t own = 70;       // tokens of each fork's own after the prefix
    bool interleaved = false;     // own tokens appended a few at a time, forks taking turns
    std::uint32_t spare = 256;    // free cells left over
};

template <class Cache>
kvcache::model_shape shared_shape(const shared_cfg& c) {
    constexpr std::uint32_t blk = block_cells<typename Cache::layout>;
    kvcache::model_shape s;
    s.n_layer = 2;
    s.n_head_kv = c.n_head_kv;
    s.head_dim_k = c.dk;
    const std::uint32_t n = c.prefix + c.n_fork * (c.own + 2 * blk) + c.spare;
    s.n_cells = (n + blk - 1) / blk * blk;
    s.n_seq_max = c.n_fork + 1;
    return s;
}

// A prefix forked to n_fork sequences (seq_cp), each then extended by its own tokens;
// NaN K/V in every free cell.
template <class Cache>
void shared_build(Cache& cache, const shared_cfg& c, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto& s = cache.shape();
    std::vector<pos_t> next(c.n_fork, 0);
    auto append = [&](seq_id_t sq, std::uint32_t n) {
        std::vector<pos_t> pos(n);
        std::vector<seq_id_t> seq(n, sq);
        for (auto& p : pos) p = next[static_cast<std::size_t>(sq)]++;
        auto placed = cache.place(pos, seq);
        REQUIRE(placed.ok());
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            std::vector<float> k(n * s.k_row_size()), v(n * s.v_row_size());
            for (auto& x : k) x = nd(rng);
            for (auto& x : v) x = nd(rng);
            cache.write_k(l, placed.value().cells, k.data());
            cache.write_v(l, placed.value().cells, v.data());
        }
        static_cast<void>(cache.commit());
    };
    for (std::uint32_t done = 0; done < c.prefix; done += 128) append(0, std::min<std::uint32_t>(128, c.prefix - done));
    for (seq_id_t f = 1; f < static_cast<seq_id_t>(c.n_fork); ++f) {
        REQUIRE(cache.seq_cp(0, f, 0, static_cast<pos_t>(c.prefix)));
        next[static_cast<std::size_t>(f)] = static_cast<pos_t>(c.prefix);
    }
    if (c.interleaved) {
        for (std::uint32_t done = 0; done < c.own;) {
            const std::uint32_t n = std::min<std::uint32_t>(1 + rng() % 6, c.own - done);
            for (seq_id_t f = 0; f < static_cast<seq_id_t>(c.n_fork); ++f) append(f, n);
            done += n;
        }
    } else {
        for (seq_id_t f = 0; f < static_cast<seq_id_t>(c.n_fork); ++f) append(f, c.own);
    }
    kvtest::fill_free_cells(cache, std::numeric_limits<float>::quiet_NaN());
}

// One decode row per fork, a 5-row chunk of fork 1's last positions, a row of the last
// fork inside the prefix (it sees part of it); shuffled.
template <class Cache>
rows shared_rows(const Cache& cache, const shared_cfg& c, std::uint32_t n_head, std::mt19937& rng) {
    rows r;
    for (seq_id_t f = 0; f < static_cast<seq_id_t>(c.n_fork); ++f) {
        r.pos.push_back(cache.seq_pos_max(f) + 1);
        r.seq.push_back(f);
    }
    for (pos_t i = 0; i < 5; ++i) {
        r.pos.push_back(cache.seq_pos_max(1) - i);
        r.seq.push_back(1);
    }
    r.pos.push_back(static_cast<pos_t>(c.prefix / 2));
    r.seq.push_back(static_cast<seq_id_t>(c.n_fork - 1));
    std::vector<std::size_t> perm(r.pos.size());
    for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    rows o;
    for (std::size_t i : perm) {
        o.pos.push_back(r.pos[i]);
        o.seq.push_back(r.seq[i]);
    }
    std::normal_distribution<float> nd(0.0f, 1.0f);
    o.q.resize(std::size_t{o.size()} * n_head * cache.shape().dim_k());
    for (auto& x : o.q) x = nd(rng);
    return o;
}

// Slot groups of `want` slots (as ops::attention cuts them: 16s, then 1/2/4/8/16).
std::size_t shared_groups(std::size_t want) {
    std::size_t n = 0;
    while (want > 0) {
        const std::size_t m = want >= 16 ? 16 : want > 8 ? 16 : want > 4 ? 8 : want > 2 ? 4 : want;
        want -= std::min(want, m);
        ++n;
    }
    return n;
}

// attention_plan's items run in a shuffled order on this thread, and by `workers`
// std::threads taking items from a shared counter: the bits of ops::attention.
template <class Cache>
void plan_check(const Cache& cache, const rows& r, const ops::attention_params& p, std::uint32_t seed) {
    const std::size_t n_out = std::size_t{r.size()} * p.n_head * cache.shape().dim_v();
    ops::attention_workspace ws, ws_plan;
    std::mt19937 rng(seed);
    for (std::uint32_t layer = 0; layer < cache.shape().n_layer; ++layer) {
        const auto want = run(cache, layer, r, p, ws);
        {
            std::vector<float> out(n_out, -7.0f);
            ops::attention_plan<Cache> plan(cache, layer, r.q.data(), r.pos.data(), r.seq.data(), r.size(), p,
                                            out.data(), ws_plan);
            REQUIRE(plan.n_items() > 0);
            std::vector<std::size_t> order(plan.n_items());
            for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
            std::shuffle(order.begin(), order.end(), rng);
            ops::attention_scratch sc;
            CHECK_THROWS_AS(plan.run_item(plan.n_items(), sc), kvcache::error);
            for (std::size_t k = 0; k + 1 < order.size(); ++k) plan.run_item(order[k], sc);
            CHECK_THROWS_AS(plan.finish(), kvcache::error);  // one item left
            plan.run_item(order.back(), sc);
            plan.finish();
            CHECK(same_bits(out.data(), want.data(), n_out));
        }
        for (int workers : {2, 3}) {
            std::vector<float> out(n_out, -7.0f);
            ops::attention_plan<Cache> plan(cache, layer, r.q.data(), r.pos.data(), r.seq.data(), r.size(), p,
                                            out.data(), ws_plan);
            std::vector<std::size_t> order(plan.n_items());
            for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
            std::shuffle(order.begin(), order.end(), rng);
            std::atomic<std::size_t> next{0};
            std::vector<std::thread> pool;
            for (int w = 0; w < workers; ++w)
                pool.emplace_back([&] {
                    ops::attention_scratch sc;
                    for (std::size_t k; (k = next.fetch_add(1)) < order.size();) plan.run_item(order[k], sc);
                });
            for (auto& t : pool) t.join();
            plan.finish();
            CHECK_MESSAGE(same_bits(out.data(), want.data(), n_out), "workers ", workers);
        }
    }
}

}  // namespace

TEST_CASE_TEMPLATE("attention: shared prefixes (forks after seq_cp) match the oracle, read once, bit-identical alone",
                   C, layout_combo<kvcache::f16, row_major>, layout_combo<kvcache::f32, paged_t>) {
    using cache_t = typename C::cache;
    std::uint32_t seed = 2026112611u;
    struct shared_case {
        std::uint32_t group;
        std::int32_t window;
        bool interleaved;
    };
    bool first = true;
    for (const shared_case sc : {shared_case{4, 0, false}, shared_case{1, 300, true}, shared_case{8, 700, false}}) {
        CAPTURE(sc.group);
        CAPTURE(sc.window);
        CAPTURE(sc.interleaved);
        shared_cfg c;
        c.interleaved = sc.interleaved;
        cache_t cache(shared_shape<cache_t>(c));
        shared_build(cache, c, seed);
        ops::attention_params p;
        p.n_head = c.n_head_kv * sc.group;
        p.window = sc.window;
        std::mt19937 rng(seed++);
        const rows r = shared_rows(cache, c, p.n_head, rng);
        check_call(cache, r, p);
        if (!sc.interleaved) {
            // The prefix is one segment for every row (read once per 16 slots), each fork's
            // own tiles one segment for its rows: items per KV head = the groups of all rows'
            // slots + each fork's groups (one part each: < 4096 cells).
            std::size_t want_items = shared_groups(std::size_t{r.size()} * sc.group);
            for (seq_id_t f = 0; f < static_cast<seq_id_t>(c.n_fork); ++f)
                want_items += shared_groups(std::size_t(std::count(r.seq.begin(), r.seq.end(), f)) * sc.group);
            std::vector<float> out(std::size_t{r.size()} * p.n_head * c.dk);
            ops::attention_workspace ws;
            ops::attention_plan<cache_t> plan(cache, 0, r.q.data(), r.pos.data(), r.seq.data(), r.size(), p,
                                              out.data(), ws);
            CHECK(plan.n_items() == want_items * c.n_head_kv);
        }
        if (!first) continue;
        first = false;
        auto pn = p;
        pn.deterministic = false;
        pn.n_threads = 2;
        check_call(cache, r, pn);
        plan_check(cache, r, p, seed);
        plan_check(cache, r, pn, seed + 1);
    }
}

TEST_CASE("attention: a long shared prefix cut into parts; plans on the scalar path and empty calls") {
    using cache_t = kvcache::kv_cache<kvcache::f16>;
    shared_cfg c;
    c.prefix = 8600;  // two parts of the prefix's segment in deterministic mode
    c.n_head_kv = 1;
    c.n_fork = 3;
    c.own = 100;
    cache_t cache(shared_shape<cache_t>(c));
    shared_build(cache, c, 77u);
    ops::attention_params p;
    p.n_head = c.n_head_kv * 4;
    std::mt19937 rng(78u);
    const rows r = shared_rows(cache, c, p.n_head, rng);
    check_call(cache, r, p);
    plan_check(cache, r, p, 79u);
    auto ps = p;
    ps.path = ops::kernel_path::scalar;
    plan_check(cache, r, ps, 80u);
    // No rows: no items, finish() at once.
    ops::attention_workspace ws;
    ops::attention_plan<cache_t> empty(cache, 0, nullptr, nullptr, nullptr, 0, p, nullptr, ws);
    CHECK(empty.n_items() == 0);
    empty.finish();
    // Bad arguments throw at construction, as ops::attention does.
    std::vector<float> out(std::size_t{r.size()} * p.n_head * c.dk, -7.0f);
    auto pb = p;
    pb.n_head = 0;
    CHECK_THROWS_AS(ops::attention_plan<cache_t>(cache, 0, r.q.data(), r.pos.data(), r.seq.data(), r.size(), pb,
                                                 out.data(), ws),
                    kvcache::error);
    for (float x : out) CHECK(x == -7.0f);
}

TEST_CASE_TEMPLATE("kshift_plan: items in any order, on any threads, give apply_k_shift's bits", C,
                   layout_combo<kvcache::f16, row_major>, layout_combo<kvcache::f32, paged_rm>) {
    using cache_t = typename C::cache;
    shared_cfg c;
    c.prefix = 600;
    c.n_fork = 3;
    c.own = 90;
    c.interleaved = true;
    c.spare = 2048;  // seq_add on shared cells gives the mover copies
    cache_t a(shared_shape<cache_t>(c)), b(shared_shape<cache_t>(c));
    shared_build(a, c, 5u);
    shared_build(b, c, 5u);
    for (cache_t* x : {&a, &b}) {
        REQUIRE(x->seq_add(1, 200, -1, 9));
        REQUIRE(x->seq_add(2, 0, 300, -17));
        REQUIRE(x->has_shift());
    }
    ops::apply_k_shift(a, 2);
    for (std::size_t items : {std::size_t{0}, std::size_t{7}}) {
        CAPTURE(items);
        cache_t& t = b;
        if (items == 7) {  // a second shift on both, through a plan of 7 items
            REQUIRE(a.seq_add(0, 100, -1, 3));
            REQUIRE(t.seq_add(0, 100, -1, 3));
            ops::apply_k_shift(a, 1);
        }
        ops::kshift_plan<cache_t> plan(t, items);
        REQUIRE(plan.n_items() > 0);
        CHECK_THROWS_AS(plan.run_item(plan.n_items()), kvcache::error);
        CHECK_THROWS_AS(plan.finish(), kvcache::error);  // nothing ran: shifts kept
        CHECK(t.has_shift());
        std::vector<std::size_t> order(plan.n_items());
        for (std::size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
        std::atomic<std::size_t> next{0};
        std::vector<std::thread> pool;
        for (int w = 0; w < 2; ++w)
            pool.emplace_back([&] {
                for (std::size_t k; (k = next.fetch_add(1)) < order.size();) plan.run_item(order[k]);
            });
        for (auto& th : pool) th.join();
        plan.finish();
        CHECK_FALSE(t.has_shift());
        const auto& s = a.shape();
        bool same = true;
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            const auto va = a.storage().view(l), vb = t.storage().view(l);
            for (std::uint32_t cell = 0; cell < a.capacity(); ++cell)
                for (std::uint32_t h = 0; h < s.n_head_kv; ++h)
                    for (std::uint32_t d = 0; d < s.dim_k(); ++d)
                        same = same && std::memcmp(&va.k[va.k_offset(h, cell, d)], &vb.k[vb.k_offset(h, cell, d)],
                                                   sizeof(va.k[0])) == 0;
        }
        CHECK(same);
    }
}
