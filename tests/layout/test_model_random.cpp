// Model-based random test over every layout: the same random operations drive a cache
// and the layout-independent reference model (reference/layout_model.hpp); after every
// step each sequence's contents (positions, pending shifts, K/V values of every layer)
// must match, a refused call must leave the cache bit-identical (cache_snapshot: every
// cell, index and K/V byte), and paged and ring caches must pass their table invariants
// (paged: free + referenced == total, refcounts, block tables).
// Ring caches also run seq_add / seq_div (executed when the layout allows them) against
// a second model that never prunes: whatever the ring accepted, every sequence must see
// exactly what that model sees in the window of its next token (positions from
// last + 2 - Window on), so the refusals are the only place where pruning shows.
#include <doctest/doctest.h>

#include <kvcache/element/bf16.hpp>
#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "layout_test_util.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;
using kvtest::layout_model;

template <class Cache>
constexpr std::uint32_t window_of() {
    if constexpr (requires { Cache::layout::window; })
        return Cache::layout::window;
    else
        return 0;
}

template <class Cache>
void check_tables(const Cache& cache) {
    if constexpr (requires { cache.storage().check_invariants(cache.cells()); })
        REQUIRE(cache.storage().check_invariants(cache.cells()) == "");
}

/// Ring: every sequence holds exactly what a cache that never pruned holds in the window
/// of its next token, and is empty only when that cache's sequence is too.
void check_window(const std::vector<kvtest::model_seq>& ring, const std::vector<kvtest::model_seq>& full,
                  std::uint32_t window) {
    for (std::size_t s = 0; s < ring.size(); ++s) {
        CAPTURE(s);
        if (ring[s].empty()) {
            REQUIRE(full[s].empty());
            continue;
        }
        const pos_t last = ring[s].rbegin()->first;
        REQUIRE(full[s].rbegin()->first == last);
        const std::int64_t from = std::int64_t{last} + 2 - window;
        kvtest::model_seq a, b;
        for (const auto& e : ring[s])
            if (e.first >= from) a.insert(e);
        for (const auto& e : full[s])
            if (e.first >= from) b.insert(e);
        REQUIRE(kvtest::diff({a}, {b}) == "");
    }
}

template <class Cache>
void run_random(const model_shape& shape, std::uint32_t seed, int steps) {
    std::printf("layout random test: %s seed %u\n", std::string(Cache::layout::name).c_str(), seed);
    constexpr std::uint32_t window = window_of<Cache>();
    constexpr bool is_ring = window > 0;
    Cache cache(shape);
    layout_model model(shape.n_seq_max);
    layout_model full(shape.n_seq_max);  // ring: the same operations, never pruned
    std::mt19937 rng(seed);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const auto n_seq = static_cast<int>(shape.n_seq_max);
    int refused = 0, applied = 0, moved = 0;
    auto max_of = [&](seq_id_t s) { return cache.seq_pos_max(s); };

    for (int step = 0; step < steps; ++step) {
        CAPTURE(step);
        const auto before = kvtest::snapshot(cache);
        const int op = pick(0, 99);
        bool ok = true;
        // A sequence operation the cache refuses with an error result (expected conditions:
        // ring limits, full pools) ends the step like a thrown refusal, as a result_refusal.
        struct result_refusal {
            errc code;
            std::string message;
        };
        const auto got = [](kvcache::result<void> r) {
            if (!r) throw result_refusal{r.code(), r.message()};
        };
        try {
            if (op < 45) {  // one or two micro-batches, then commit or restore
                const int n_ub = pick(1, 2);
                for (int u = 0; u < n_ub && ok; ++u) {
                    seq_set set;
                    const int n_in_set = pick(0, 9) == 0 ? 2 : 1;
                    while (set.count() < std::min(n_in_set, n_seq)) set.set(pick(0, n_seq - 1));
                    pos_t next = 0;
                    set.for_each([&](seq_id_t s) { next = std::max(next, max_of(s) + 1); });
                    // batch position rule: a non-empty sequence continues at its last position + 1
                    set.for_each([&](seq_id_t s) {
                        if (max_of(s) >= 0 && max_of(s) + 1 != next) set.reset(s);
                    });
                    const int n = pick(1, 6);
                    const int gap = next > 0 ? 0 : is_ring ? pick(0, 1) : pick(0, 3);  // only where every sequence is empty
                    std::vector<pos_t> pos(static_cast<std::size_t>(n));
                    for (int i = 0; i < n; ++i) pos[static_cast<std::size_t>(i)] = next + gap + i;
                    std::vector<seq_set> sets(static_cast<std::size_t>(n), set);
                    ok = kvtest::place_and_write(cache, model, pos, sets, rng, &full);
                }
                if (pick(0, 3) == 0) {
                    cache.restore();
                    model.restore();
                    full.restore();
                } else {
                    const bool committed = cache.commit() == tx_result::committed;  // ring prunes only then
                    model.commit();
                    full.commit();
                    if (is_ring && committed) model.prune(window);
                }
                if (!ok) {  // a refused batch changes nothing; earlier ones were restored/committed above
                    ++refused;
                    ok = true;
                }
            } else if (op < 60) {
                const seq_id_t s = pick(0, 9) == 0 ? -1 : pick(0, n_seq - 1);
                const pos_t p0 = pick(-1, 40), p1 = pick(0, 3) == 0 ? -1 : p0 + pick(0, 20);
                got(cache.seq_rm(s, p0, p1));
                model.seq_rm(s, p0, p1);
                full.seq_rm(s, p0, p1);
            } else if (op < 72) {
                const seq_id_t src = pick(0, n_seq - 1), dst = pick(0, n_seq - 1);
                const pos_t p0 = pick(0, 3) == 0 ? -1 : pick(0, 30), p1 = pick(0, 2) == 0 ? -1 : p0 + pick(1, 30);
                got(cache.seq_cp(src, dst, p0, p1));
                model.seq_cp(src, dst, p0, p1);
                full.seq_cp(src, dst, p0, p1);
            } else if (op < 75) {
                const seq_id_t s = pick(0, n_seq - 1);
                cache.seq_keep(s);
                model.seq_keep(s);
                full.seq_keep(s);
            } else if (op < 90) {
                const seq_id_t s = pick(0, 5) == 0 ? -1 : pick(0, n_seq - 1);
                const pos_t p0 = pick(0, 1) == 0 ? -1 : pick(0, 30);
                const pos_t d = pick(-10, 10);
                got(cache.seq_add(s, p0, -1, d));
                model.seq_add(s, p0, -1, d);
                full.seq_add(s, p0, -1, d);
                moved += d != 0;
            } else if (op < 96) {
                const seq_id_t s = pick(0, 5) == 0 ? -1 : pick(0, n_seq - 1);
                const int d = pick(1, 3);
                got(cache.seq_div(s, -1, -1, d));
                model.seq_div(s, -1, -1, d);
                full.seq_div(s, -1, -1, d);
                moved += d != 1;
            } else {
                cache.clear();
                model.clear();
                full.clear();
            }
            ++applied;
        } catch (const result_refusal& r) {
            // Expected conditions this test provokes on purpose: ring limits, full pools (results).
            CAPTURE(r.message);
            REQUIRE((r.code == errc::unsupported || r.code == errc::no_space));
            REQUIRE(kvtest::snapshot(cache) == before);
            ++refused;
        } catch (const kvcache::error& e) {
            // Programming errors it provokes on purpose (exceptions): copies onto held positions.
            const bool expected = e.code() == errc::invalid_argument &&
                                  std::string(e.what()).find("already holds") != std::string::npos;
            CAPTURE(e.what());
            REQUIRE(expected);
            REQUIRE(kvtest::snapshot(cache) == before);
            ++refused;
        }
        REQUIRE_FALSE(cache.in_transaction());
        CAPTURE(op);
        const auto seen = kvtest::observe(cache);
        REQUIRE(kvtest::diff(seen, model.seqs) == "");
        if constexpr (is_ring) check_window(seen, full.seqs, window);
        check_tables(cache);
    }
    std::printf("  %d steps applied (%d moved positions), %d refused\n", applied, moved, refused);
    CHECK(applied > steps / 2);
    CHECK(moved > steps / 20);
}

}  // namespace

TEST_CASE("random operations: contiguous matches the reference model") {
    run_random<kv_cache<f32>>(kvtest::layout_shape(128, 4), 101, 600);
    run_random<kv_cache<f16, contiguous<v_layout::transposed>>>(kvtest::layout_shape(96, 3), 102, 400);
}

TEST_CASE("random operations: paged matches the reference model") {
    run_random<kv_cache<f32, paged<32>>>(kvtest::layout_shape(256, 4), 201, 800);
    run_random<kv_cache<f16, paged<32, v_layout::transposed>>>(kvtest::layout_shape(256, 3), 202, 600);
    run_random<kv_cache<f32, paged<32>>>(kvtest::layout_shape(64, 4), 203, 800);  // tight: many refusals
}

TEST_CASE("random operations: ring matches the reference model with pruning, refuses what it cannot do") {
    run_random<kv_cache<f32, ring<8>>>(kvtest::layout_shape(ring<8>::cells_for(4, 8), 4), 301, 800);
    run_random<kv_cache<bf16, ring<5, v_layout::transposed>>>(kvtest::layout_shape(ring<5>::cells_for(3, 8), 3), 302,
                                                               600);
    run_random<kv_cache<f16, ring<40>>>(kvtest::layout_shape(ring<40>::cells_for(3, 12), 3), 303, 800);  // rarely pruned
}
