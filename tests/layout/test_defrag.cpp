// ops::defrag on the contiguous layout under random fragmentation: every sequence's
// contents (positions, pending shifts, K/V bytes of every layer) are bit-identical
// before and after, float64 reference attention is bit-identical, the f32 attention
// kernel agrees to rounding, the move bound holds, and refused calls change nothing.
#include <doctest/doctest.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/ops/attention.hpp>
#include <kvcache/io/state.hpp>
#include <kvcache/ops/defrag.hpp>
#include <kvcache/ops/kshift.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "layout_test_util.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;

template <class Cache>
void fragment(Cache& cache, kvtest::layout_model& model, std::mt19937& rng, int rounds) {
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const auto n_seq = static_cast<int>(cache.shape().n_seq_max);
    for (int r = 0; r < rounds; ++r) {
        const seq_id_t s = pick(0, n_seq - 1);
        const int op = pick(0, 9);
        if (op < 6) {
            if (kvtest::append(cache, model, s, cache.seq_pos_max(s) + 1, static_cast<std::uint32_t>(pick(1, 24)), rng)) {
                cache.commit();
                model.commit();
            }
        } else if (op < 9) {
            const pos_t p0 = pick(0, std::max(0, cache.seq_pos_max(s))), p1 = p0 + pick(1, 20);
            REQUIRE(cache.seq_rm(s, p0, p1));
            model.seq_rm(s, p0, p1);
        } else {
            const pos_t p0 = pick(0, 50), d = pick(-3, 3);  // pending shifts move with their cells
            REQUIRE(cache.seq_add(s, p0, -1, d));
            model.seq_add(s, p0, -1, d);
        }
    }
}

template <class Cache>
std::vector<float> attention_all(const Cache& cache_in, std::uint32_t layer, const std::vector<float>& q,
                                 ops::kernel_path path) {
    // ops::attention refuses pending K-shifts (fragment() leaves some): on a copy made
    // through a state (which carries the pending shifts), with them applied.
    Cache cache(cache_in.shape());
    REQUIRE(kvcache::io::load_state(cache, kvcache::io::save_state(cache_in)).ok());
    ops::apply_k_shift(cache);
    const auto n_seq = cache.shape().n_seq_max;
    std::vector<pos_t> qp(n_seq);
    std::vector<seq_id_t> qs(n_seq);
    for (std::uint32_t s = 0; s < n_seq; ++s) {
        qs[s] = static_cast<seq_id_t>(s);
        qp[s] = std::max<pos_t>(0, cache.seq_pos_max(static_cast<seq_id_t>(s)));
    }
    ops::attention_params ap;
    ap.n_head = cache.shape().n_head_kv;
    ap.path = path;
    std::vector<float> out(std::size_t{n_seq} * ap.n_head * cache.shape().dim_v());
    ops::attention_workspace ws;
    ops::attention(cache, layer, q.data(), qp.data(), qs.data(), n_seq, ap, out.data(), ws);
    return out;
}

}  // namespace

TEST_CASE_TEMPLATE("defrag: contents bit-identical, attention unchanged, under random fragmentation", Cache,
                   kv_cache<f16>, kv_cache<f32, contiguous<v_layout::transposed>>) {
    for (std::uint32_t seed : {31u, 32u, 33u}) {
        std::printf("defrag test seed %u\n", seed);
        CAPTURE(seed);
        std::mt19937 rng(seed);
        const auto shape = kvtest::layout_shape(512, 4, 2, 2, 16);
        Cache cache(shape);
        kvtest::layout_model model(4);
        fragment(cache, model, rng, 80);
        REQUIRE(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
        const auto before = kvtest::observe(cache);
        std::vector<float> q(std::size_t{shape.n_seq_max} * shape.n_head_kv * shape.dim_k());
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (auto& x : q) x = u(rng);
        const auto att_before = attention_all(cache, 1, q, ops::kernel_path::scalar);
        const double frag = ops::fragmentation(cache);
        const std::uint32_t used = cache.used();
        ops::defrag_params p;
        p.threshold = 0.0f;
        p.min_cells = 1;
        const auto res = ops::defrag(cache, p);
        CHECK(cache.used() == used);
        CHECK(kvtest::diff(kvtest::observe(cache), before) == "");
        CHECK(kvtest::same(kvtest::observe(cache), before));
        if (frag > 0) {
            CHECK(res.moves > 0);
            CHECK(res.bytes_moved == res.moves * cache.bytes_per_token());
        }
        CHECK(ops::fragmentation(cache) == 0.0);  // unbounded pass: fully compact
        CHECK(cache.cells().last_used() + 1 == cache.used());
        // float64 reference attention over the sequences' contents: bit-identical
        const auto now = kvtest::observe(cache);
        for (std::uint32_t s = 0; s < 4; ++s) {
            const auto& seq = now[s];
            const auto& old = before[s];
            const pos_t qp = std::max<pos_t>(0, cache.seq_pos_max(static_cast<seq_id_t>(s)));
            for (std::uint32_t h = 0; h < shape.n_head_kv; ++h) {
                const float* qr = q.data() + (s * shape.n_head_kv + h) * shape.dim_k();
                CHECK(kvtest::attention_ref(seq, 1, h, shape.dim_k(), shape.dim_v(), qr, qp, 0) ==
                      kvtest::attention_ref(old, 1, h, shape.dim_k(), shape.dim_v(), qr, qp, 0));
            }
        }
        // the f32 kernel visits cells in a new order: equal up to rounding
        const auto att_after = attention_all(cache, 1, q, ops::kernel_path::scalar);
        for (std::size_t i = 0; i < att_before.size(); ++i) CHECK(std::abs(att_after[i] - att_before[i]) < 1e-5f);
        // the cache keeps working: more random operations, checked against a model of its contents
        kvtest::layout_model after(4);
        after.seqs = kvtest::observe(cache);
        fragment(cache, after, rng, 40);
        CHECK(kvtest::diff(kvtest::observe(cache), after.seqs) == "");
    }
}

TEST_CASE("defrag: bounded moves per pass, thresholds, refusals") {
    std::mt19937 rng(34);
    const auto shape = kvtest::layout_shape(256, 2);
    kv_cache<f16> cache(shape);
    kvtest::layout_model model(2);
    for (int i = 0; i < 8; ++i) {
        REQUIRE(kvtest::append(cache, model, i % 2, static_cast<pos_t>(i / 2 * 30), 30, rng));
        cache.commit();
    }
    REQUIRE(cache.seq_rm(0, -1, -1));  // holes: every other run of 30 cells
    const auto before = kvtest::observe(cache);
    const double frag = ops::fragmentation(cache);
    CHECK(frag > 0.4);

    ops::defrag_params p;
    p.threshold = 0.9f;  // above the fragmentation: nothing to do
    CHECK(ops::defrag(cache, p).moves == 0);
    p.threshold = 0.1f;
    p.min_cells = 1024;  // n below min_cells: nothing to do
    CHECK(ops::defrag(cache, p).moves == 0);
    p.min_cells = 128;
    p.max_moves = 10;
    const auto r1 = ops::defrag(cache, p);
    CHECK(r1.moves == 10);
    CHECK(ops::fragmentation(cache) < frag);
    CHECK(kvtest::diff(kvtest::observe(cache), before) == "");
    p.max_moves = 0;
    const auto r2 = ops::defrag(cache, p);
    CHECK(r1.moves + r2.moves == 60);  // the runs of sequence 1 above cell 120
    CHECK(ops::fragmentation(cache) == 0.0);
    CHECK(kvtest::diff(kvtest::observe(cache), before) == "");

    // refused: bad threshold, open transaction; nothing changed
    p.threshold = 1.5f;
    CHECK_THROWS_WITH_AS(ops::defrag(cache, p), doctest::Contains("threshold = 1.5"), kvcache::error);
    p.threshold = 0.0f;
    REQUIRE(cache.seq_rm(1, 0, 30));
    const auto before2 = kvtest::observe(cache);
    REQUIRE(kvtest::append(cache, model, 0, 0, 1, rng));
    CHECK_THROWS_WITH_AS(ops::defrag(cache, p), doctest::Contains("transaction_open"), kvcache::error);
    cache.restore();
    CHECK(kvtest::diff(kvtest::observe(cache), before2) == "");
}
