// ring<Window>: constant memory far past the window, attention equal to a float64
// reference that sees only the last Window positions of the full history, and the
// refusals (seq_add / seq_div / seq_rm that need pruned positions, placement beyond
// the region) that leave the cache unchanged. Moving positions with RoPE, context
// shift, forks and seq_cp are in test_ring_shift.cpp.
#include <doctest/doctest.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/ops/attention.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "layout_test_util.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;
constexpr std::uint32_t ring_w = 24;
using ring_cache = kv_cache<f32, ring<ring_w>>;

}  // namespace

TEST_CASE("ring: configuration errors name the parameter") {
    CHECK_THROWS_WITH_AS(ring_cache(kvtest::layout_shape(2 * ring_w, 2)), doctest::Contains("model_shape.n_cells = 48"),
                         kvcache::error);
    CHECK(ring<ring_w>::cells_for(2, 8) == 2 * (ring_w + 8));
    ring_cache ok(kvtest::layout_shape(ring<ring_w>::cells_for(2, 8), 2));
    CHECK(ok.storage().region() == ring_w + 8);
    CHECK_THROWS_AS(static_cast<void>(ok.storage().pruned_below(2)), kvcache::error);
}

TEST_CASE("ring: generation far past the window keeps memory constant and attention windowed") {
    const std::uint32_t seed = 21;
    std::printf("ring generation test seed %u\n", seed);
    std::mt19937 rng(seed);
    const auto shape = kvtest::layout_shape(ring<ring_w>::cells_for(2, 16), 2, 2, 2, 16);
    ring_cache cache(shape);
    kvtest::layout_model model(2);  // pruned like the ring
    kvtest::layout_model full(2);   // full history, never pruned
    const std::size_t bytes = cache.total_bytes();
    pos_t next[2] = {0, 0};
    std::uniform_int_distribution<int> ub(1, 16);
    ops::attention_workspace ws;
    int checked = 0;
    for (int step = 0; step < 120; ++step) {
        const seq_id_t s = step % 2;
        const auto n = static_cast<std::uint32_t>(ub(rng));
        REQUIRE(kvtest::append(cache, model, s, next[s], n, rng));
        for (const auto& [p, t] : model.seqs[static_cast<std::size_t>(s)])  // the same new rows
            if (p >= next[s]) full.put(s, p, t);
        next[s] += static_cast<pos_t>(n);
        cache.commit();
        model.commit();
        full.commit();
        model.prune(ring_w);
        REQUIRE(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
        CHECK(cache.used() <= 2 * ring_w);
        CHECK(cache.total_bytes() == bytes);
        // every sequence keeps exactly its last min(ring_w, length) positions
        for (seq_id_t t = 0; t < 2; ++t)
            if (next[t] > 0) {
                CHECK(cache.seq_pos_max(t) == next[t] - 1);
                CHECK(cache.seq_pos_min(t) == std::max<pos_t>(0, next[t] - static_cast<pos_t>(ring_w)));
            }
        // decode-style query at the last position: ring attention == float64 reference over
        // the full history restricted to the window
        const std::uint32_t n_head = 4, dk = shape.dim_k(), dv = shape.dim_v();
        std::vector<float> q(n_head * dk);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (auto& x : q) x = u(rng);
        const pos_t qp = next[s] - 1;
        for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
          for (ops::kernel_path path : {ops::kernel_path::scalar, ops::kernel_path::simd}) {
            const auto out = kvtest::decode_attention(cache, layer, q, qp, s, n_head, static_cast<std::int32_t>(ring_w),
                                                      path, ws);
            for (std::uint32_t g = 0; g < n_head; ++g) {
                const auto ref = kvtest::attention_ref(full.seqs[static_cast<std::size_t>(s)], layer,
                                                       g / (n_head / shape.n_head_kv), dk, dv,
                                                       q.data() + g * dk, qp, static_cast<std::int32_t>(ring_w));
                for (std::uint32_t d = 0; d < dv; ++d) REQUIRE(std::abs(out[g * dv + d] - ref[d]) < 1e-4);
            }
          }
            ++checked;
        }
    }
    CHECK(next[0] > static_cast<pos_t>(10 * ring_w));
    CHECK(checked == 240);
}

TEST_CASE("ring: refuses what needs pruned positions, allows what does not, changes nothing when refusing") {
    std::mt19937 rng(22);
    ring_cache cache(kvtest::layout_shape(ring<ring_w>::cells_for(2, 8), 2));
    kvtest::layout_model model(2);
    for (pos_t p = 0; p < 100; p += 4) {
        REQUIRE(kvtest::append(cache, model, 0, p, 4, rng));
        cache.commit();
    }
    model.commit();
    model.prune(ring_w);
    CHECK(cache.storage().pruned_below(0) == 100 - static_cast<pos_t>(ring_w));
    const auto before = kvtest::observe(cache);
    auto unchanged = [&] { CHECK(kvtest::diff(kvtest::observe(cache), before) == ""); };

    // seq_add / seq_div: (a) a range reaching below the pruning point (76)
    CHECK(kvtest::refused_result(cache.seq_add(0, -1, -1, 3), "cannot move the range [0, end)"));
    unchanged();
    CHECK(kvtest::refused_result(cache.seq_div(0, 70, -1, 2), "no positions below 76"));
    unchanged();
    CHECK(kvtest::refused_result(cache.seq_add(-1, 75, 90, 1), "unsupported"));
    unchanged();
    // (b) lowering the end to 97: the next token's window would start at 97 + 2 - 24 = 75 < 76
    CHECK(kvtest::refused_result(cache.seq_add(0, 90, -1, -2), "would end at 97"));
    unchanged();
    CHECK(kvtest::refused_result(cache.seq_div(0, 80, -1, 2), "window would start at"));
    unchanged();
    // middle range reaching below the pruning point (76)
    CHECK(kvtest::refused_result(cache.seq_rm(0, 50, 80), "pruned by the sliding window"));
    unchanged();
    CHECK(kvtest::refused_result(cache.seq_rm(-1, 10, 20), "unsupported"));
    unchanged();
    // truncation whose next window would reach pruned positions: 89 + 2 - 24 = 67 < 76
    CHECK(kvtest::refused_result(cache.seq_rm(0, 90, -1), "truncating at 90 leaves it ending at 89"));
    unchanged();
    // allowed: a middle range inside the window, a truncation with an intact window,
    // moves that keep every later window above the pruning point (up; down by one)
    REQUIRE(cache.seq_rm(0, 80, 82));
    model.seq_rm(0, 80, 82);
    REQUIRE(cache.seq_rm(0, 99, -1));
    model.seq_rm(0, 99, -1);
    CHECK(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
    REQUIRE(cache.seq_add(0, 90, -1, 5));  // 90..98 -> 95..103
    model.seq_add(0, 90, -1, 5);
    REQUIRE(cache.seq_add(0, 100, -1, -1));  // ends at 102: 102 + 2 - 24 = 80 >= 76
    model.seq_add(0, 100, -1, -1);
    REQUIRE(cache.seq_div(0, 101, 103, 1));  // d = 1: nothing moves
    CHECK(cache.has_shift());
    CHECK(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
    CHECK(cache.storage().pruned_below(0) == 76);
    // a truncation that would leave nothing here while a full cache keeps positions below 76
    const auto moved = kvtest::observe(cache);
    CHECK(kvtest::refused_result(cache.seq_rm(0, 76, -1), "removes every position held here"));
    CHECK(kvtest::diff(kvtest::observe(cache), moved) == "");
    // seq_cp passes the pruning point on: the copy cannot be truncated into pruned data either
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    model.seq_cp(0, 1, -1, -1);
    CHECK(cache.storage().pruned_below(1) == cache.storage().pruned_below(0));
    CHECK(kvtest::refused_result(cache.seq_rm(1, 85, -1), "unsupported"));
    // removing a whole sequence is always allowed and resets its pruning point
    REQUIRE(cache.seq_rm(0, 0, -1));
    model.seq_rm(0, 0, -1);
    CHECK(cache.storage().pruned_below(0) == 0);
    REQUIRE(kvtest::append(cache, model, 0, 0, 5, rng));
    cache.commit();  // also prunes sequence 1 below 102 - 24 + 1 = 79
    model.commit();
    model.prune(ring_w);
    REQUIRE(cache.seq_rm(0, 2, 3));
    model.seq_rm(0, 2, 3);
    CHECK(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
}

TEST_CASE("ring: a batch that finds its region full is refused with no_space; out-of-order positions fit") {
    std::mt19937 rng(23);
    ring_cache cache(kvtest::layout_shape(ring<ring_w>::cells_for(2, 8), 2));  // regions of ring_w + 8 = 32
    kvtest::layout_model model(2);
    REQUIRE(kvtest::append(cache, model, 0, 0, 20, rng));
    cache.commit();
    const auto before = kvtest::observe(cache);
    std::vector<pos_t> pos(13);
    for (int i = 0; i < 13; ++i) pos[static_cast<std::size_t>(i)] = 20 + i;
    std::vector<seq_id_t> seq(13, 0);
    auto r = cache.place(pos, seq);  // 13 tokens, 12 free cells: the window still needs 0..19
    REQUIRE_FALSE(r.ok());
    CHECK(r.code() == errc::no_space);
    CHECK(r.message().find("has no free cell for position") != std::string::npos);
    CHECK_FALSE(cache.in_transaction());
    CHECK(kvtest::diff(kvtest::observe(cache), before) == "");
    // positions moved to 12..31 (cells 0..19): 32 and 33 map to the cells of positions 12
    // and 13, still held: they take the next free cells (batches continue the last position)
    REQUIRE(cache.seq_add(0, -1, -1, 12));
    model.seq_add(0, -1, -1, 12);
    REQUIRE(kvtest::append(cache, model, 0, 32, 2, rng));
    cache.commit();
    model.commit();
    model.prune(ring_w);
    CHECK(kvtest::diff(kvtest::observe(cache), model.seqs) == "");
    CHECK(cache.seq_pos_min(0) == std::max<pos_t>(12, 33 - static_cast<pos_t>(ring_w) + 1));
}
