// Chunk reuse (reuse::apply_plan) and Self-Extend (ops::self_extend) on ring<Window>:
// several seq_rm / seq_add / seq_div calls each, checked whole before the first one runs
// (the ring's check_seq_steps hook):
//   - on a pruned ring, a plan or a Self-Extend that needs pruned positions at any of its
//     steps is refused with errc::unsupported, the cache bit-identical (cache_snapshot)
//     and its pruning point unchanged;
//   - what the ring allows (nothing pruned yet, or every step above the pruning point)
//     gives the same result as a contiguous cache: the same positions from the pruning
//     point on, and the same windowed attention after the K-shift, both checked against
//     a float64 reference that never prunes (roped_reference.hpp);
//   - random plans and Self-Extend parameters on a pruned ring: refused whole, or equal
//     to the contiguous cache;
//   - a malformed plan is refused before its first step on every layout;
//   - ops::memory on a ring whose split copies reached the cells past the last region.
#include <doctest/doctest.h>

#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/ops/context_shift.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/ops/memory.hpp>
#include <kvcache/tokens/prompt_tokens.hpp>
#include <kvcache/reuse/plan.hpp>

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
constexpr std::uint32_t reuse_w = 16;
using reuse_ring_cache = kv_cache<f32, ring<reuse_w>>;
using flat_cache = kv_cache<f32>;

model_shape roped_shape(std::uint32_t n_cells) {
    model_shape s = kvtest::layout_shape(n_cells, 2, 2, 2, 16);
    s.rope = {rope_type::neox, 10000.0f, 1.0f, 0};
    return s;
}

/// A ring and a contiguous cache holding the same tokens, and the reference.
struct twins {
    reuse_ring_cache swa{roped_shape(ring<reuse_w>::cells_for(2, 8))};
    flat_cache flat{roped_shape(256)};
    std::vector<kvtest::roped_seq> ref = std::vector<kvtest::roped_seq>(2);

    /// Positions [p0, p0 + n) of sequence 0 in both caches, batches of at most 8.
    void fill(pos_t p0, pos_t n, std::mt19937& rng) {
        for (pos_t p = p0; p < p0 + n; p += 8)
            REQUIRE(kvtest::put_roped(swa, ref, 0, p, static_cast<std::uint32_t>(std::min<pos_t>(8, p0 + n - p)), rng,
                                      flat));
    }
    /// The steps applied to the reference.
    void on_ref(const std::vector<seq_step>& steps) {
        for (const auto& st : steps) kvtest::ref_step(ref[0], st);
    }
    /// After the same operations on both caches: the ring holds the contiguous cache's
    /// positions from its pruning point on, the next token's window starts at or above it,
    /// and attention of the next position (and of the last when nothing was pruned) matches
    /// the reference in both (after the K-shift); then both generate past the window and
    /// still match.
    void check_same(pos_t n_past, std::mt19937& rng) {
        const pos_t w = swa.storage().pruned_below(0);
        std::map<pos_t, std::uint32_t> want;
        for (const auto& [p, n] : flat.cells().seq_positions(0))
            if (p >= w) want[p] = n;
        CHECK(swa.cells().seq_positions(0) == want);
        CHECK(swa.seq_pos_max(0) == flat.seq_pos_max(0));
        CHECK((w == 0 || std::int64_t{flat.seq_pos_max(0)} + 2 - reuse_w >= w));
        CHECK(swa.storage().check_invariants(swa.cells()) == "");
        ops::apply_k_shift(swa);
        ops::apply_k_shift(flat);
        for (pos_t qp : {n_past - 1, n_past}) {  // the last token's own window may need pruned positions
            if (qp < 0 || (qp < n_past && w > 0)) continue;
            CAPTURE(qp);
            kvtest::check_roped_attention(swa, ref[0], 0, qp, rng, reuse_w);
            kvtest::check_roped_attention(flat, ref[0], 0, qp, rng, reuse_w);
        }
        for (pos_t p = n_past; p < n_past + static_cast<pos_t>(reuse_w) + 5; p += 3) {
            REQUIRE(kvtest::put_roped(swa, ref, 0, p, 3, rng, flat));
            kvtest::check_roped_attention(swa, ref[0], 0, p + 2, rng, reuse_w);
        }
        kvtest::check_roped_attention(flat, ref[0], 0, swa.seq_pos_max(0), rng, reuse_w);
    }
};

std::vector<seq_step> plan_steps(const reuse::plan& p) {
    std::vector<seq_step> out;
    reuse::for_each_step(p, [&](const seq_step& st) { out.push_back(st); });
    return out;
}
std::vector<seq_step> self_extend_steps(const ops::self_extend_state& st, pos_t n_past) {
    std::vector<seq_step> out;
    ops::detail_ctx::self_extend_steps(st, n_past, [&](const seq_step& x) { out.push_back(x); });
    return out;
}

reuse::plan make(std::uint32_t n_lcp, std::vector<reuse::chunk_move> moves, std::uint32_t n_past) {
    reuse::plan p;
    p.n_lcp = n_lcp;
    p.moves = std::move(moves);
    p.n_past = n_past;
    p.n_request = n_past + 1;
    return p;
}

/// Checks that op() throws `code` with a message containing every needle and changes
/// nothing in the ring (bytes, cells, pruning point).
template <class Op>
void refused(reuse_ring_cache& c, Op op, std::vector<const char*> needles, errc code = errc::unsupported) {
    const auto before = kvtest::snapshot(c);
    const pos_t w = c.storage().pruned_below(0);
    const kvtest::refusal r = kvtest::run_refusal(op);  // arguments throw; pruned positions are a result
    REQUIRE_MESSAGE(r.kind != kvtest::refusal_kind::none, "not refused");
    CHECK(r.kind == kvtest::rule_kind(code));
    CHECK(r.code == code);
    for (const char* n : needles) CHECK_MESSAGE(r.message.find(n) != std::string::npos, r.message);
    CHECK(kvtest::snapshot(c) == before);
    CHECK(c.storage().pruned_below(0) == w);
    CHECK(c.storage().check_invariants(c.cells()) == "");
}

}  // namespace

TEST_CASE("ring reuse: chunk reuse before anything is pruned equals a contiguous cache") {
    const std::uint32_t seed = 71;
    std::printf("ring reuse unpruned seed %u\n", seed);
    std::mt19937 rng(seed);
    for (const auto& p : {make(4, {{7, 4, 7}}, 11), make(2, {{4, 2, 3}, {9, 5, 4}}, 9), make(0, {{3, 0, 8}}, 8)}) {
        twins t;
        t.fill(0, 14, rng);  // 14 < reuse_w: nothing pruned
        REQUIRE(t.swa.storage().pruned_below(0) == 0);
        REQUIRE(reuse::apply_plan(t.swa, 0, p));
        REQUIRE(reuse::apply_plan(t.flat, 0, p));
        t.on_ref(plan_steps(p));
        CHECK(t.swa.seq_pos_max(0) == static_cast<pos_t>(p.n_past) - 1);
        t.check_same(static_cast<pos_t>(p.n_past), rng);
    }
}

TEST_CASE("ring reuse: a plan that needs pruned positions at any step is refused whole") {
    std::mt19937 rng(72);
    twins t;
    t.fill(0, 40, rng);
    REQUIRE(t.swa.storage().pruned_below(0) == 24);  // 39 - 16 + 1
    // step 1 alone would run; step 2 lowers the end by 3: the next window would start at 22
    refused(t.swa, [&] { return reuse::apply_plan(t.swa, 0, make(30, {{33, 30, 7}}, 37)); },
            {"apply_plan: step 2 of 3", "seq_rm(0, 30, 33), seq_add(0, 33, 40, -3), seq_rm(0, 37, end)",
             "no positions below 24", "would end at 36"});
    // four steps run, the final truncation would leave the sequence ending at 30
    refused(t.swa, [&] { return reuse::apply_plan(t.swa, 0, make(26, {{27, 26, 3}, {32, 29, 2}}, 31)); },
            {"apply_plan: step 5 of 5", "no positions below 24", "leaves it ending at 30"});
    // the first step reaches below the pruning point
    refused(t.swa, [&] { return reuse::apply_plan(t.swa, 0, make(10, {{20, 10, 20}}, 30)); },
            {"apply_plan: step 1 of 3", "cannot remove the range [10, 20)"});
    // no move: the plain seq_rm refusal, as before
    refused(t.swa, [&] { return reuse::apply_plan(t.swa, 0, make(30, {}, 30)); }, {"seq_rm: sequence 0", "ending at 29"});
    // what the contiguous cache does with the same plans
    REQUIRE(reuse::apply_plan(t.flat, 0, make(30, {{33, 30, 7}}, 37)));
    CHECK(t.flat.seq_pos_max(0) == 36);
}

TEST_CASE("ring reuse: chunk reuse above the pruning point equals a contiguous cache") {
    const std::uint32_t seed = 73;
    std::printf("ring reuse pruned seed %u\n", seed);
    std::mt19937 rng(seed);
    // every step at or above 24; the end drops by one (39 -> 38), the next window starts at 24
    for (const auto& p : {make(30, {{31, 30, 9}}, 39), make(27, {{28, 27, 3}, {31, 30, 9}}, 39),
                          make(40, {}, 40)}) {
        twins t;
        t.fill(0, 40, rng);
        REQUIRE(t.swa.storage().pruned_below(0) == 24);
        REQUIRE(reuse::apply_plan(t.swa, 0, p));
        REQUIRE(reuse::apply_plan(t.flat, 0, p));
        t.on_ref(plan_steps(p));
        t.check_same(static_cast<pos_t>(p.n_past), rng);
    }
}

TEST_CASE("ring reuse: Self-Extend on a pruned ring is refused whole where a step needs pruned positions") {
    std::mt19937 rng(74);
    twins t;
    t.fill(0, 40, rng);
    REQUIRE(t.swa.storage().pruned_below(0) == 24);
    // round 1: seq_add(26, 40, 26) and seq_div(52, 56, 2) alone would run; the third call
    // lowers the end to 37 and the next window would start at 23
    ops::self_extend_state st{2, 4, 26};
    refused(t.swa, [&] { return ops::self_extend(t.swa, 0, st, 40); },
            {"self_extend: step 3 of ", "seq_add(0, 26, 40, 26), seq_div(0, 52, 56, 2), seq_add(0, 56, 66, -28)",
             "no positions below 24", "would end at 37"});
    CHECK(st.ga_i == 26);
    ops::self_extend_state from0{4, 16, 0};
    refused(t.swa, [&] { return ops::self_extend(t.swa, 0, from0, 40); }, {"self_extend: step 1 of", "reaches below it"});
    CHECK(from0.ga_i == 0);
    // the contiguous cache takes both
    CHECK(ops::self_extend(t.flat, 0, st, 40).value() < 40);
}

TEST_CASE("ring reuse: Self-Extend above the pruning point equals a contiguous cache") {
    const std::uint32_t seed = 75;
    std::printf("ring self-extend seed %u\n", seed);
    std::mt19937 rng(seed);
    twins t;
    t.fill(0, 40, rng);
    REQUIRE(t.swa.storage().pruned_below(0) == 24);
    // one round (ga_n 2, ga_w 2: bd = 1) from ga_i 38: 38, 39 -> 76, 77 -> 38, 38; ends at 38
    ops::self_extend_state a{2, 2, 38}, b = a;
    const auto steps = self_extend_steps(a, 40);
    const pos_t np = ops::self_extend(t.swa, 0, a, 40).value();
    CHECK(ops::self_extend(t.flat, 0, b, 40).value() == np);
    CHECK(np == 39);
    CHECK(a.ga_i == b.ga_i);
    t.on_ref(steps);
    t.check_same(np, rng);
}

TEST_CASE("ring reuse: random plans and Self-Extends on a pruned ring are refused whole or equal a contiguous cache") {
    const std::uint32_t seed = 76;
    std::printf("ring reuse random seed %u\n", seed);
    std::mt19937 rng(seed);
    int n_refused = 0, n_done = 0;
    for (int round = 0; round < 24; ++round) {
        CAPTURE(round);
        twins t;
        const pos_t n_tok = 20 + static_cast<pos_t>(rng() % 30);
        t.fill(0, n_tok, rng);
        const bool extend = round % 3 == 2;
        reuse::plan p;
        ops::self_extend_state st;
        if (extend) {
            st.ga_n = 1 + static_cast<int>(rng() % 3);
            st.ga_w = st.ga_n * (1 + static_cast<int>(rng() % 3));
            st.ga_i = n_tok - static_cast<pos_t>(rng() % 12);
        } else {  // a request that keeps a prefix, drops a few tokens and reuses what follows
            std::vector<token_t> cached(static_cast<std::size_t>(n_tok));
            for (auto& x : cached) x = static_cast<token_t>(rng() % 1000);
            std::vector<token_t> req(cached.begin(), cached.begin() + (n_tok - 1 - static_cast<pos_t>(rng() % 12)));
            const auto keep = static_cast<std::ptrdiff_t>(req.size());
            const auto gap = std::min<std::ptrdiff_t>(1 + static_cast<std::ptrdiff_t>(rng() % 3), n_tok - keep);
            req.insert(req.end(), cached.begin() + keep + gap, cached.end());
            req.push_back(1000);
            p = reuse::make_plan(prompt_tokens(cached), prompt_tokens(req), {.min_chunk = 1 + static_cast<std::uint32_t>(rng() % 4)});
        }
        const auto steps = extend ? self_extend_steps(st, n_tok) : plan_steps(p);
        const ops::self_extend_state st0 = st;
        const auto before = kvtest::snapshot(t.swa);
        pos_t n_past = static_cast<pos_t>(p.n_past);
        errc refusal = errc::ok;  // pruned positions: an error result, not an exception
        if (extend) {
            const auto r = ops::self_extend(t.swa, 0, st, n_tok);
            if (r) n_past = r.value();
            refusal = r.code();
        } else {
            refusal = reuse::apply_plan(t.swa, 0, p).code();
        }
        if (refusal != errc::ok) {
            CHECK(refusal == errc::unsupported);
            CHECK(kvtest::snapshot(t.swa) == before);
            CHECK(st.ga_i == st0.ga_i);
            ++n_refused;
            continue;
        }
        ++n_done;
        if (extend) {
            ops::self_extend_state flat_st = st0;
            CHECK(ops::self_extend(t.flat, 0, flat_st, n_tok).value() == n_past);
            CHECK(flat_st.ga_i == st.ga_i);
        } else {
            REQUIRE(reuse::apply_plan(t.flat, 0, p));
        }
        t.on_ref(steps);
        t.check_same(n_past, rng);
    }
    std::printf("ring reuse random: %d refused whole, %d equal to the contiguous cache\n", n_refused, n_done);
    CHECK(n_refused > 0);
    CHECK(n_done > 0);
}

TEST_CASE("apply_plan: a malformed plan is refused before its first step (any layout)") {
    std::mt19937 rng(77);
    twins t;
    t.fill(0, 14, rng);
    const auto before = kvtest::snapshot(t.flat);
    auto bad = [&](const reuse::plan& p, const char* needle) {
        CHECK_THROWS_WITH_AS(static_cast<void>(reuse::apply_plan(t.flat, 0, p)),
                             doctest::Contains(needle), kvcache::error);
        CHECK(kvtest::snapshot(t.flat) == before);
        refused(t.swa, [&] { return reuse::apply_plan(t.swa, 0, p); }, {needle}, errc::invalid_argument);
    };
    // the first move is fine; the second one's seq_rm(dst, src) would be a reversed range
    bad(make(2, {{4, 2, 3}, {6, 9, 2}}, 7), "moves[1] = {src 6, dst 9, n 2}");
    bad(make(2, {{4, -1, 3}}, 5), "moves[0] = {src 4, dst -1, n 3}");
    bad(make(2, {{4, 2, 0x7ffffffe}}, 5), "src + n < 2^31");
    bad(make(0, {}, 0x80000000u), "n_past = 2147483648");
}

TEST_CASE("ops::memory on a ring: occupied cells past the last region count as held") {
    // n_cells = 19, two regions of 9 (ring<8>): cell 18 lies past the last region
    kv_cache<f32, ring<8>> c(kvtest::layout_shape(19, 2));
    std::mt19937 rng(78);
    kvtest::layout_model model(2);
    REQUIRE(kvtest::append(c, model, 0, 0, 8, rng));  // region 0: cells 0..7
    c.commit();
    REQUIRE(c.seq_cp(0, 1, -1, -1));
    REQUIRE(c.seq_add(1, 0, -1, 1));  // 8 split copies: region 1, cells 9..16
    REQUIRE(c.seq_cp(1, 0, 8, 9));
    REQUIRE(c.seq_add(0, 8, 9, 1));   // sequence 0's copy fills region 0 (cell 8)
    REQUIRE(c.seq_cp(0, 1, 9, 10));
    REQUIRE(c.seq_add(1, 9, 10, 1));  // sequence 1's copy fills region 1 (cell 17)
    REQUIRE(c.seq_cp(0, 1, 0, 1));
    REQUIRE(c.seq_add(1, 0, 1, 20));  // both regions full: the copy goes to cell 18
    REQUIRE(c.used() == 19);
    CHECK_FALSE(c.cells().is_free(18));
    const auto m = ops::memory(c);
    CHECK(m.held_bytes == std::size_t{19} * c.bytes_per_token());
    CHECK(m.held_bytes >= m.used_bytes);
    CHECK(m.waste_bytes() == 0);
    CHECK(c.storage().check_invariants(c.cells()) == "");
}
