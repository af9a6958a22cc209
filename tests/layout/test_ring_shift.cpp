// ring<Window> with moving positions and shared cells, checked by attention against a
// float64 reference that keeps every position ever written (never pruned) and applies
// RoPE at each token's current position (reference/rope_ref.hpp):
//   - seq_add / K-shift / context shift on a ring, through both K-shift kernel paths;
//   - the refusals on a pruned ring leave the cache bit-identical (cache_snapshot);
//   - a fork whose source generates 10 x Window tokens while the fork idles: no
//     no_space, constant memory, both sequences' attention right, the fork's cells
//     moved into its own region;
//   - splits of shared cells by seq_add, and the seq_cp rules.
#include <doctest/doctest.h>

#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/ops/attention.hpp>
#include <kvcache/ops/context_shift.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/ops/memory.hpp>
#include <kvcache/ops/rope.hpp>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "layout_test_util.hpp"
#include "roped_reference.hpp"
#include "support/cache_snapshot.hpp"
#include "support/result_check.hpp"

namespace {

using namespace kvcache;
constexpr std::uint32_t shift_w = 24;
using shift_ring_cache = kv_cache<f32, ring<shift_w>>;

model_shape roped_shape(std::uint32_t n_seq, std::uint32_t max_ubatch) {
    model_shape s = kvtest::layout_shape(ring<shift_w>::cells_for(n_seq, max_ubatch), n_seq, 2, 2, 16);
    s.rope = {rope_type::neox, 10000.0f, 1.0f, 0};
    return s;
}

using ref_seq = kvtest::roped_seq;

bool put(shift_ring_cache& c, std::vector<ref_seq>& ref, seq_id_t s, pos_t p0, std::uint32_t n, std::mt19937& rng) {
    return kvtest::put_roped(c, ref, s, p0, n, rng);
}
template <class F>
void move(ref_seq& m, pos_t p0, pos_t p1, F f) {
    kvtest::ref_move(m, p0, p1, f);
}
void check_attention(const shift_ring_cache& c, const ref_seq& ref, seq_id_t s, pos_t qp, std::mt19937& rng) {
    kvtest::check_roped_attention(c, ref, s, qp, rng, shift_w);
}

/// Cells of sequence s, and how many of them lie in region r.
std::uint32_t cells_in_region(const shift_ring_cache& c, seq_id_t s, std::uint32_t r) {
    std::uint32_t n = 0;
    const std::uint32_t R = c.storage().region();
    for (std::uint32_t cell : c.cells().used_cells())
        n += c.cells().seqs(cell).test(s) && cell / R == r;
    return n;
}

}  // namespace

TEST_CASE("ring: context shift and seq_add before anything is pruned, K-shift on ring storage (both paths)") {
    for (ops::kernel_path kpath : {ops::kernel_path::scalar, ops::kernel_path::simd}) {
        const std::uint32_t seed = kpath == ops::kernel_path::scalar ? 51 : 52;
        std::printf("ring context shift test seed %u\n", seed);
        std::mt19937 rng(seed);
        shift_ring_cache cache(roped_shape(2, 16));
        std::vector<ref_seq> ref(2);
        REQUIRE(put(cache, ref, 0, 0, 20, rng));  // 20 < shift_w: nothing pruned
        CHECK(cache.storage().pruned_below(0) == 0);
        // F13: keep 4, discard 8: [4, 12) removed, [12, 20) moved to [4, 12)
        const auto r = ops::context_shift(cache, 0, 4, 8).value();
        CHECK(r.n_past_after == 12);
        ref[0].erase(ref[0].lower_bound(4), ref[0].lower_bound(12));
        move(ref[0], 12, -1, [](pos_t p) { return std::int64_t{p} - 8; });
        CHECK(cache.has_shift());
        ops::apply_k_shift(cache, 1, kpath);
        CHECK_FALSE(cache.has_shift());
        CHECK(cache.storage().check_invariants(cache.cells()) == "");
        check_attention(cache, ref[0], 0, 11, rng);
        // generation goes on far past the window: pruning, windows against the full history
        pos_t next = 12;
        for (int step = 0; step < 30; ++step) {
            const auto n = static_cast<std::uint32_t>(1 + step % 5);
            REQUIRE(put(cache, ref, 0, next, n, rng));
            next += static_cast<pos_t>(n);
            check_attention(cache, ref[0], 0, next - 1, rng);
        }
        CHECK(cache.storage().pruned_below(0) == next - static_cast<pos_t>(shift_w));
        // moves the rules allow on a pruned sequence: up, and lowering the end by one
        REQUIRE(cache.seq_add(0, next - 5, -1, 7));
        move(ref[0], next - 5, -1, [](pos_t p) { return std::int64_t{p} + 7; });
        REQUIRE(cache.seq_add(0, next + 1, -1, -1));
        move(ref[0], next + 1, -1, [](pos_t p) { return std::int64_t{p} - 1; });
        ops::apply_k_shift(cache, 1, kpath);
        check_attention(cache, ref[0], 0, next + 5, rng);
        REQUIRE(put(cache, ref, 0, next + 6, 3, rng));
        check_attention(cache, ref[0], 0, next + 8, rng);
        CHECK(cache.storage().check_invariants(cache.cells()) == "");
    }
}

TEST_CASE("ring: what needs pruned positions is refused and the cache stays bit-identical") {
    std::mt19937 rng(53);
    shift_ring_cache cache(roped_shape(2, 16));
    std::vector<ref_seq> ref(2);
    for (pos_t p = 0; p < 40; p += 8) REQUIRE(put(cache, ref, 0, p, 8, rng));
    REQUIRE(cache.storage().pruned_below(0) == 16);  // 39 - 24 + 1
    const auto before = kvtest::snapshot(cache);
    auto refused = [&](auto op, const char* needle) {  // pruned positions: an unsupported result
        const kvtest::refusal r = kvtest::run_refusal(op);
        CHECK(r.kind == kvtest::refusal_kind::returned);
        CHECK(r.code == kvcache::errc::unsupported);
        CHECK_MESSAGE(r.message.find(needle) != std::string::npos, r.message);
        CHECK(kvtest::snapshot(cache) == before);
    };
    refused([&] { return ops::context_shift(cache, 0, 4); }, "no positions below 16");  // its seq_rm refuses first
    refused([&] { return ops::context_shift(cache, 0, 0); }, "that reaches below it");
    // seq_rm of [20, 30) alone would be allowed, the move after it not: refused before either
    refused([&] { return ops::context_shift(cache, 0, 20); }, "step 2 of 2");
    refused([&] { return cache.seq_add(0, 10, -1, 2); }, "cannot move the range [10, end)");
    refused([&] { return cache.seq_add(-1, 0, 30, 1); }, "cannot move the range [0, 30)");
    refused([&] { return cache.seq_div(0, -1, -1, 2); }, "unsupported");
    refused([&] { return cache.seq_add(0, 30, -1, -2); }, "would end at 37");  // 37 + 2 - 24 = 15 < 16
    refused([&] { return cache.seq_div(0, 20, -1, 2); }, "window would start at");
    CHECK(cache.storage().check_invariants(cache.cells()) == "");
    // the boundary: lowering the end by one keeps the next window at 16
    REQUIRE(cache.seq_add(0, 30, -1, -1));
    move(ref[0], 30, -1, [](pos_t p) { return std::int64_t{p} - 1; });
    ops::apply_k_shift(cache);
    check_attention(cache, ref[0], 0, 39, rng);
}

TEST_CASE("ring: a fork idles while its source generates 10 x Window tokens (no no_space, constant memory)") {
    const std::uint32_t seed = 54;
    std::printf("ring fork test seed %u\n", seed);
    std::mt19937 rng(seed);
    shift_ring_cache cache(roped_shape(2, 4));  // regions of shift_w + 4: no room for a second window
    const std::uint32_t R = cache.storage().region();
    std::vector<ref_seq> ref(2);
    for (pos_t p = 0; p < 32; p += 4) REQUIRE(put(cache, ref, 0, p, 4, rng));
    REQUIRE(cache.seq_cp(0, 1, -1, -1));  // the fork shares sequence 0's window (in region 0)
    ref[1] = ref[0];
    CHECK(cache.storage().pruned_below(1) == cache.storage().pruned_below(0));
    const std::size_t bytes = cache.total_bytes();
    pos_t next = 32;
    for (std::uint32_t step = 0; step < 10 * shift_w; ++step) {
        CAPTURE(step);
        REQUIRE(put(cache, ref, 0, next, 1, rng));
        ++next;
        CHECK(cache.total_bytes() == bytes);
        CHECK(cache.used() == std::min(2 * shift_w, shift_w + 1 + step));  // shared cells count once
        CHECK(cache.storage().foreign_cells(0) == 0);
        CHECK(ops::memory(cache).held_bytes == std::size_t{2} * R * cache.bytes_per_token());
        if (step % 16 == 0 || step + 1 == 10 * shift_w) {
            check_attention(cache, ref[0], 0, next - 1, rng);
            check_attention(cache, ref[1], 1, 31, rng);
            check_attention(cache, ref[1], 1, 32, rng);  // the fork's next token
        }
    }
    CHECK(cells_in_region(cache, 1, 1) == shift_w);  // the fork now lives in its own region
    CHECK(cells_in_region(cache, 0, 0) == shift_w);
    CHECK(cache.storage().check_invariants(cache.cells()) == "");
    // the fork generates too
    for (pos_t p = 32; p < 40; ++p) REQUIRE(put(cache, ref, 1, p, 1, rng));
    check_attention(cache, ref[1], 1, 39, rng);
    check_attention(cache, ref[0], 0, next - 1, rng);
    // the source goes away: its region is free for a new sequence 0
    REQUIRE(cache.seq_rm(0, -1, -1));
    ref[0].clear();
    for (pos_t p = 0; p < 3 * static_cast<pos_t>(shift_w); p += 4) REQUIRE(put(cache, ref, 0, p, 4, rng));
    check_attention(cache, ref[0], 0, 3 * static_cast<pos_t>(shift_w) - 1, rng);
}

TEST_CASE("ring: a fork whose source is removed leaves foreign cells that the next commit moves home") {
    std::mt19937 rng(55);
    shift_ring_cache cache(roped_shape(2, 4));
    std::vector<ref_seq> ref(2);
    for (pos_t p = 0; p < 30; p += 3) REQUIRE(put(cache, ref, 0, p, 3, rng));
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    ref[1] = ref[0];
    REQUIRE(cache.seq_rm(0, -1, -1));  // all shift_w cells of region 0 now belong to sequence 1 only
    ref[0].clear();
    CHECK(cache.storage().foreign_cells(0) == shift_w);
    CHECK(cache.storage().pruned_below(0) == 0);
    CHECK(cache.storage().pruned_below(1) == 30 - static_cast<pos_t>(shift_w));
    std::vector<pos_t> pos(5, 0);
    for (pos_t i = 0; i < 5; ++i) pos[static_cast<std::size_t>(i)] = i;
    auto r = cache.place(pos, std::vector<seq_id_t>(5, 0));  // 4 free cells in region 0
    REQUIRE_FALSE(r.ok());
    CHECK(r.code() == errc::no_space);
    CHECK(r.message().find("belong to other sequences only") != std::string::npos);
    REQUIRE(put(cache, ref, 0, 0, 4, rng));  // fits, and its commit moves the fork's cells
    CHECK(cache.storage().foreign_cells(0) == 0);
    CHECK(cells_in_region(cache, 1, 1) == shift_w);
    for (pos_t p = 4; p < 40; p += 4) REQUIRE(put(cache, ref, 0, p, 4, rng));
    check_attention(cache, ref[0], 0, 39, rng);
    check_attention(cache, ref[1], 1, 30, rng);
    CHECK(cache.storage().check_invariants(cache.cells()) == "");
}

TEST_CASE("ring: seq_add on shared cells splits them (copies in the mover's region), K-shift per sequence") {
    std::mt19937 rng(56);
    shift_ring_cache cache(roped_shape(2, 16));
    std::vector<ref_seq> ref(2);
    REQUIRE(put(cache, ref, 0, 0, 12, rng));
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    ref[1] = ref[0];
    REQUIRE(cache.seq_add(1, 6, -1, 3));  // 6 shared cells split: sequence 1's copies go to region 1
    move(ref[1], 6, -1, [](pos_t p) { return std::int64_t{p} + 3; });
    CHECK(cells_in_region(cache, 1, 1) == 6);
    CHECK(cache.storage().foreign_cells(0) == 0);
    REQUIRE(cache.seq_add(0, 0, -1, 2));  // the remaining 6 shared cells split; sequence 1 keeps the originals
    move(ref[0], 0, -1, [](pos_t p) { return std::int64_t{p} + 2; });
    CHECK(cache.storage().foreign_cells(0) == 6);
    ops::apply_k_shift(cache);
    check_attention(cache, ref[0], 0, 13, rng);
    check_attention(cache, ref[1], 1, 14, rng);
    REQUIRE(put(cache, ref, 1, 15, 1, rng));  // a commit moves them to region 1
    CHECK(cache.storage().foreign_cells(0) == 0);
    CHECK(cells_in_region(cache, 1, 1) == 13);
    check_attention(cache, ref[1], 1, 15, rng);
    check_attention(cache, ref[0], 0, 13, rng);
    CHECK(cache.storage().check_invariants(cache.cells()) == "");
}

TEST_CASE("ring: seq_cp below the source's pruning point is refused where the copy would miss data") {
    std::mt19937 rng(57);
    kv_cache<f32, ring<shift_w>> cache(roped_shape(3, 8));
    std::vector<ref_seq> ref(3);
    for (pos_t p = 0; p < 40; p += 8) REQUIRE(put(cache, ref, 0, p, 8, rng));
    REQUIRE(cache.storage().pruned_below(0) == 16);
    const auto before = kvtest::snapshot(cache);
    CHECK(kvtest::refused_result(cache.seq_cp(0, 1, 0, 10), "none of them"));
    CHECK(kvtest::snapshot(cache) == before);
    CHECK(kvtest::refused_result(cache.seq_cp(0, 1, 10, 20), "would end at 19"));
    CHECK(kvtest::snapshot(cache) == before);
    REQUIRE(cache.seq_cp(0, 1, 20, 30));  // every position of the range is here: nothing to inherit
    CHECK(cache.storage().pruned_below(1) == 0);
    REQUIRE(cache.seq_cp(0, 2, -1, -1));
    CHECK(cache.storage().pruned_below(2) == 16);
    // truncations of the copies follow their pruning points
    REQUIRE(cache.seq_rm(1, 25, -1));  // nothing pruned in sequence 1
    CHECK(kvtest::refused_result(cache.seq_rm(2, 35, -1), "leaves it ending at 34"));
    CHECK(kvtest::refused_result(cache.seq_rm(2, 0, 30), "reaches below it"));
    REQUIRE(cache.seq_rm(2, 0, -1));
    CHECK(cache.storage().pruned_below(2) == 0);
    CHECK(cache.storage().check_invariants(cache.cells()) == "");
}
