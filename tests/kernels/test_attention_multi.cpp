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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference/attention_ref.hpp"
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
    std::normal_distribution<float> nd(0.0f, 1.0f);
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
    const float nan = std::numeric_limits<float>::quiet_NaN();
    typename Cache::storage_type bad;
    Cache::element::from_float(&nan, &bad, 1);
    for (std::uint32_t l = 0; l < s.n_layer; ++l) {
        auto v = cache.storage().view(l);
        for (std::uint32_t cell = 0; cell < v.n_cells_pad; ++cell) {
            if (cell < cache.capacity() && !cache.cells().is_free(cell)) continue;
            for (std::uint32_t h = 0; h < s.n_head_kv; ++h) {
                for (std::uint32_t d = 0; d < s.dim_k(); ++d) v.k[v.k_offset(h, cell, d)] = bad;
                for (std::uint32_t d = 0; d < s.dim_v(); ++d) v.v[v.v_offset(h, cell, d)] = bad;
            }
        }
    }
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

// The whole check for one cache type and configuration: oracle, per-sequence and
// per-row bit-identity, thread counts.
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
        for (seq_id_t sq = 0; sq <= static_cast<seq_id_t>(c.n_seq); ++sq) {
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
