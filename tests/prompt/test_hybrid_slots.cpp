// slot_manager over recurrent and hybrid memories (issue 28): checkpoints saved where
// prepared_request::checkpoints says, resumed from the newest one at or below the common
// prefix (else recomputed from 0), reported through the miss reasons and counters, kept
// with the global prompt-cache entry, bounded in number and bytes per slot. After every
// request the slot's sequence is compared with a cold computation of the same tokens.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "prompt/toy_model.hpp"
#include "support/result_check.hpp"

namespace {

using kvcache::pos_t;
using kvcache::prompt_tokens;
using kvcache::seq_id_t;
namespace reuse = kvcache::reuse;

using hyb_global_t = kvcache::hybrid_memory<kvcache::kv_cache<kvcache::f32, reuse::global<>>>;
using hyb_lcp_t = kvcache::hybrid_memory<kvcache::kv_cache<kvcache::f32, reuse::chunk_shift<4>>>;

const std::vector<bool> hybslot_layers = {true, false, true};  // recurrent, attention, recurrent

kvcache::recurrent_shape hybslot_rec_shape(std::uint32_t n_seq) {
    kvcache::recurrent_shape s;
    s.n_layer = 2;
    s.n_seq_max = n_seq;
    s.d_conv = 3;
    s.d_inner = 4;
    s.ssm_size = 5;
    return s;
}
kvcache::model_shape hybslot_attn_shape(std::uint32_t n_seq) {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 4;
    s.n_cells = 512;
    s.n_seq_max = n_seq;
    return s;
}
using hyb_iswa_t = kvcache::hybrid_memory<kvcache::iswa_cache<8, kvcache::f32, reuse::global<>>>;
const std::vector<bool> hybslot_iswa_layers = {true, false, true, false};  // recurrent, SWA, recurrent, full

template <class M>
M hybslot_make(std::uint32_t n_seq) {
    if constexpr (std::is_same_v<M, hyb_iswa_t>) {
        kvcache::iswa_shape is;
        is.shape = hybslot_attn_shape(n_seq);
        is.shape.n_layer = 2;
        is.swa_layers = {true, false};
        is.swa_n_cells = kvcache::ring<8>::cells_for(n_seq, 16);
        return M(is, hybslot_rec_shape(n_seq), hybslot_iswa_layers);
    } else {
        return M(hybslot_attn_shape(n_seq), hybslot_rec_shape(n_seq), hybslot_layers);
    }
}

/// A host engine's step over a hybrid memory: tokens [from, to) of p into seq, one batch.
/// Attention rows: a function of (token, position); recurrent states: an order-dependent
/// function of every token so far (a state resumed from a wrong point differs).
template <class M>
void hybslot_fill(M& mem, seq_id_t seq, const prompt_tokens& p, std::size_t from, std::size_t to) {
    if (from >= to) return;
    std::vector<pos_t> pos(to - from);
    std::iota(pos.begin(), pos.end(), static_cast<pos_t>(from));
    std::vector<seq_id_t> seqs(pos.size(), seq);
    kvcache::transaction tx(mem);
    auto placed = mem.place(pos, seqs).value();
    std::vector<float> rows(pos.size() * 4);
    for (std::size_t i = 0; i < pos.size(); ++i)
        for (std::size_t d = 0; d < 4; ++d)
            rows[i * 4 + d] = static_cast<float>(toy::unit(toy::mix(static_cast<std::uint64_t>(p[from + i]) * 7 + d + 100 * (from + i))));
    for (std::uint32_t l = 0; l < mem.n_layer(); ++l)
        if (!mem.is_recurrent(l)) {
            mem.write_k(l, placed, rows.data());
            mem.write_v(l, placed, rows.data());
        }
    for (std::uint32_t l = 0; l < mem.n_layer(); ++l) {
        if (!mem.is_recurrent(l)) continue;
        auto conv = mem.conv_state(l, seq);
        auto ssm = mem.ssm_state(l, seq);
        for (std::size_t i = from; i < to; ++i) {
            const float x = static_cast<float>(toy::unit(toy::mix(static_cast<std::uint64_t>(p[i]) + l)));
            for (std::size_t k = 0; k + 4 < conv.size(); ++k) conv[k] = conv[k + 4];
            for (std::size_t k = conv.size() - 4; k < conv.size(); ++k) conv[k] = x + static_cast<float>(k);
            for (std::size_t k = 0; k < ssm.size(); ++k) ssm[k] = ssm[k] * 0.75f + x * static_cast<float>(k + 1) + conv[k % conv.size()] * 0.125f;
        }
    }
    tx.commit();
}

/// Runs a request as a host does: prepare, compute in pieces that end at every listed
/// checkpoint (save_checkpoint there), commit; then compares the sequence's recurrent
/// state with a cold computation of the whole request.
template <class Slots, class M>
kvcache::prepared_request hybslot_run(Slots& slots, M& mem, const prompt_tokens& req, kvcache::request_options ro = {},
                                      bool save = true) {
    auto p = slots.prepare(req, ro).value();
    REQUIRE(p.metrics.hit_tokens() + p.metrics.computed == req.size());
    REQUIRE(mem.seq_pos_max(p.seq) == static_cast<pos_t>(p.n_past) - 1);
    std::size_t at = p.n_past;
    for (std::uint32_t b : p.checkpoints) {
        REQUIRE(b > at);
        hybslot_fill(mem, p.seq, req, at, b);
        at = b;
        if (save) REQUIRE(slots.save_checkpoint(p.slot));
    }
    hybslot_fill(mem, p.seq, req, at, req.size());
    slots.commit_prompt(p.slot);
    M cold = hybslot_make<M>(mem.n_seq_max());
    for (std::size_t i = 0; i < req.size(); i += 16) hybslot_fill(cold, 0, req, i, std::min(req.size(), i + 16));
    const auto got = mem.recurrent().seq_state(p.seq);
    const auto want = cold.recurrent().seq_state(0);
    REQUIRE(std::vector<float>(got.begin(), got.end()) == std::vector<float>(want.begin(), want.end()));
    slots.release(p.slot);
    return p;
}

}  // namespace

TEST_CASE("hybrid slots: checkpoints serve exact repeats and shorter prefixes; none: recompute, reported") {
    hyb_global_t mem = hybslot_make<hyb_global_t>(4);
    kvcache::slot_manager<hyb_global_t> slots(mem, {.n_slots = 2, .checkpoint_every = 16, .checkpoint_tail = 1});
    static_assert(kvcache::slot_manager<hyb_global_t>::has_recurrent_state);
    const prompt_tokens a = toy::text(40);

    auto r = hybslot_run(slots, mem, a, {.slot_id = 0});
    CHECK(r.n_past == 0);
    CHECK(r.checkpoints == std::vector<std::uint32_t>{16, 32, 39});
    CHECK(slots.n_checkpoints(0) == 3);
    CHECK(slots.checkpoint_bytes(0) > 0);

    // exact repeat: resumes from the checkpoint one token before the end
    r = hybslot_run(slots, mem, a, {.slot_id = 0});
    CHECK(r.n_past == 39);
    CHECK(r.metrics.checkpoint_restored);
    CHECK(r.metrics.miss == kvcache::miss_reason::none);
    CHECK(r.metrics.computed == 1);

    // growing by 3 tokens: continues the slot's own state, no checkpoint needed
    const prompt_tokens a3 = toy::cat(a, toy::text(3, 500));
    r = hybslot_run(slots, mem, a3, {.slot_id = 0});
    CHECK(r.n_past == 40);
    CHECK(!r.metrics.checkpoint_restored);
    CHECK(r.metrics.computed == 3);

    // a prompt sharing 20 tokens: the newest checkpoint at or below 20 is at 16, reported
    const prompt_tokens b = toy::cat(toy::text(20), toy::text(12, 900));
    r = hybslot_run(slots, mem, b, {.slot_id = 0, .checkpoint_at = {18, 25, 200}});
    CHECK(r.n_past == 16);
    CHECK(r.metrics.checkpoint_restored);
    CHECK(r.metrics.miss == kvcache::miss_reason::no_checkpoint);
    CHECK(r.checkpoints == std::vector<std::uint32_t>{18, 25, 31});  // 200: beyond the request
    CHECK(slots.metrics().misses_for(kvcache::miss_reason::no_checkpoint) == 1);
    CHECK(slots.metrics().checkpoints_restored == 2);

    // the global entry of `a` carries its checkpoints into another slot
    r = hybslot_run(slots, mem, a, {.slot_id = 1});
    CHECK(r.metrics.from_global == 39);
    CHECK(r.metrics.checkpoint_restored);

    // nothing saved: an exact repeat recomputes from 0, with the miss reason
    kvcache::slot_manager<hyb_global_t> bare(mem, {.n_slots = 1, .first_seq = 3});
    r = hybslot_run(bare, mem, a, {}, false);
    r = hybslot_run(bare, mem, a, {}, false);
    CHECK(r.n_past == 0);
    CHECK(r.metrics.miss == kvcache::miss_reason::no_checkpoint);
    CHECK(!r.metrics.checkpoint_restored);
    CHECK(bare.metrics().misses_for(kvcache::miss_reason::no_checkpoint) == 1);
    CHECK(kvcache::to_prometheus(bare.metrics()).find("reason=\"no_checkpoint\"} 1") != std::string::npos);
}

TEST_CASE("hybrid slots + storage tiers: only a blob whose whole state fits the request is taken") {
    using chain = kvcache::tier::tier_cache<hyb_global_t, kvcache::tier::memory_tier>;
    static_assert(!chain::can_cut);
    chain tc({.block_tokens = 8}, kvcache::tier::memory_tier());
    const prompt_tokens a = toy::text(40);
    {  // one engine serves `a` and publishes its state on release
        hyb_global_t m1 = hybslot_make<hyb_global_t>(4);
        kvcache::slot_manager<hyb_global_t> s1(m1, {.n_slots = 2, .checkpoint_every = 16});
        s1.attach_tiers(tc, {.scratch_seq = 3});
        CHECK(hybslot_run(s1, m1, a).n_past == 0);
        REQUIRE(tc.metrics().published == 1);
    }
    {  // another engine: an exact repeat may keep 39 positions; the 40-position state cannot be cut: a miss, not a refusal
        hyb_global_t m2 = hybslot_make<hyb_global_t>(4);
        kvcache::slot_manager<hyb_global_t> s2(m2, {.n_slots = 2, .checkpoint_every = 16});
        s2.attach_tiers(tc, {.scratch_seq = 3});
        const auto r = hybslot_run(s2, m2, a);
        CHECK(r.n_past == 0);
        CHECK(r.metrics.from_tier == 0);
        CHECK(tc.metrics().fetch_hits == 0);
        CHECK(tc.metrics().tiers[0].refused_for(kvcache::tier::refusal::load) == 0);
    }
    // a third: `a` and 3 more tokens: the whole state fits, taken (compared with a cold run)
    hyb_global_t mem = hybslot_make<hyb_global_t>(4);
    kvcache::slot_manager<hyb_global_t> slots(mem, {.n_slots = 2, .checkpoint_every = 16});
    slots.attach_tiers(tc, {.scratch_seq = 3});
    const auto r = hybslot_run(slots, mem, toy::cat(a, toy::text(3, 500)));
    CHECK(r.n_past == 40);
    CHECK(r.metrics.from_tier == 40);
    CHECK(r.metrics.tier == 0);
    CHECK(mem.seq_pos_max(3) < 0);
    CHECK(slots.metrics().hit_tokens_tier == 40);
}

TEST_CASE("hybrid slots: checkpoints bounded in number and bytes per slot, oldest dropped, counted") {
    hyb_lcp_t mem = hybslot_make<hyb_lcp_t>(2);
    const prompt_tokens a = toy::text(60);
    {
        kvcache::slot_manager<hyb_lcp_t> slots(mem, {.n_slots = 1, .max_checkpoints = 2, .checkpoint_every = 10});
        auto r = hybslot_run(slots, mem, a);
        CHECK(r.checkpoints.size() == 6);  // 10..50 and 59
        CHECK(slots.n_checkpoints(0) == 2);
        CHECK(slots.metrics().checkpoints_saved == 6);
        CHECK(slots.metrics().checkpoints_dropped == 4);
        // chunk reuse is off for recurrent layers: a shifted repeat keeps only the prefix
        const prompt_tokens b = toy::cat(toy::text(55), toy::text(5, 77));
        r = hybslot_run(slots, mem, b);
        CHECK(r.metrics.from_shift == 0);
        CHECK(r.n_past == 50);  // the newest kept checkpoint at or below 55
        slots.clear_slot(0);
    }
    {
        kvcache::slot_manager<hyb_lcp_t> one(mem, {.n_slots = 1, .checkpoint_every = 10});
        hybslot_run(one, mem, a);
        const std::size_t all = one.checkpoint_bytes(0);
        one.clear_slot(0);
        CHECK(one.checkpoint_bytes(0) == 0);
        kvcache::slot_manager<hyb_lcp_t> slots(mem, {.n_slots = 1, .max_checkpoint_bytes = all / 2, .checkpoint_every = 10});
        hybslot_run(slots, mem, a);
        CHECK(slots.checkpoint_bytes(0) <= all / 2);
        CHECK(slots.n_checkpoints(0) >= 1);
        CHECK(slots.metrics().checkpoints_dropped >= 1);
        // a transaction open: save_checkpoint throws, nothing changed
        const std::size_t n = slots.n_checkpoints(0);
        const std::vector<pos_t> pos = {60};
        const std::vector<seq_id_t> sq = {0};
        auto placed = mem.place(pos, sq);
        REQUIRE(placed);
        CHECK_THROWS_AS(static_cast<void>(slots.save_checkpoint(0)), kvcache::error);
        static_cast<void>(mem.restore());
        CHECK(slots.n_checkpoints(0) == n);
    }
}

TEST_CASE("recurrent_memory slots and apply_plan: exact prefix only, moves refused") {
    kvcache::recurrent_memory rec(hybslot_rec_shape(2));
    kvcache::slot_manager<kvcache::recurrent_memory> slots(rec, {.n_slots = 1});
    auto p = slots.prepare(toy::text(10)).value();
    CHECK(p.checkpoints == std::vector<std::uint32_t>{9});
    const std::vector<pos_t> pos = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    const std::vector<seq_id_t> sq(9, 0);
    static_cast<void>(rec.place(pos, sq).value());
    static_cast<void>(rec.commit());
    REQUIRE(slots.save_checkpoint(p.slot));
    const std::vector<pos_t> last = {9};
    static_cast<void>(rec.place(last, std::vector<seq_id_t>{0}).value());
    static_cast<void>(rec.commit());
    slots.commit_prompt(p.slot);
    slots.release(p.slot);
    p = slots.prepare(toy::text(10)).value();
    CHECK(p.n_past == 9);
    CHECK(p.metrics.checkpoint_restored);
    CHECK(rec.seq_pos_max(0) == 8);
    slots.release(p.slot);

    reuse::plan moved;
    moved.n_request = 10;
    moved.n_past = 4;
    moved.n_lcp = 2;
    moved.moves = {{4, 2, 2}};
    CHECK_THROWS_AS(static_cast<void>(reuse::apply_plan(rec, 0, moved)), kvcache::error);
    reuse::plan cut;
    cut.n_request = 10;
    cut.n_past = 3;
    cut.n_lcp = 3;
    auto r = reuse::apply_plan(rec, 0, cut);  // rec holds [0, 8]: cutting at 3 is refused
    CHECK(!r);
    CHECK(r.code() == kvcache::errc::unsupported);
    CHECK(rec.seq_pos_max(0) == 8);
    hyb_global_t mem = hybslot_make<hyb_global_t>(1);
    CHECK_THROWS_AS(static_cast<void>(reuse::apply_plan(mem, 0, moved)), kvcache::error);
}

TEST_CASE("hybrid slots: model-based random requests, every one compared with a cold computation") {
    // Requests drawn from a few shared prefixes with random continuations, on two slots and
    // the global cache, with random checkpoint boundaries and hosts that sometimes skip
    // checkpoints. After each request: the slot's recurrent state equals a cold run
    // (hybslot_run), the metrics add up, and a reuse below the slot's own tokens happened
    // only through a restored checkpoint or a reported miss.
    hyb_global_t mem = hybslot_make<hyb_global_t>(2);
    kvcache::slot_manager<hyb_global_t> slots(
        mem, {.n_slots = 2, .max_checkpoints = 3, .max_checkpoint_bytes = 64 << 10, .checkpoint_every = 8});
    std::uint64_t rng = 12345;
    auto next = [&](std::uint64_t n) {
        rng = toy::mix(rng);
        return rng % n;
    };
    const std::vector<prompt_tokens> stems = {toy::text(24, 1000), toy::text(24, 3000), toy::text(9, 5000)};
    std::uint64_t restored = 0, lost = 0;
    for (int step = 0; step < 40; ++step) {
        CAPTURE(step);
        prompt_tokens req = stems[next(stems.size())];
        req.keep_first(1 + next(req.size()));
        req.append(toy::text(next(12), static_cast<kvcache::token_t>(20000 + 100 * step)).tokens());
        kvcache::request_options ro;
        ro.slot_id = next(3) == 0 ? static_cast<int>(next(2)) : -1;
        if (next(2) == 0) ro.checkpoint_at = {static_cast<std::uint32_t>(next(30)), static_cast<std::uint32_t>(next(30))};
        const bool save = next(5) != 0;
        const auto r = hybslot_run(slots, mem, req, ro, save);
        for (std::size_t i = 1; i < r.checkpoints.size(); ++i) REQUIRE(r.checkpoints[i - 1] < r.checkpoints[i]);
        for (std::uint32_t b : r.checkpoints) REQUIRE((b > r.n_past && b < r.n_request));
        REQUIRE(slots.checkpoint_bytes(r.slot) <= std::size_t{64} << 10);
        REQUIRE(slots.n_checkpoints(r.slot) <= 3);
        restored += r.metrics.checkpoint_restored;
        lost += r.metrics.miss == kvcache::miss_reason::no_checkpoint;
    }
    const auto m = slots.metrics();
    CHECK(m.requests == 40);
    CHECK(m.checkpoints_restored == restored);
    CHECK(m.misses_for(kvcache::miss_reason::no_checkpoint) == lost);
    CHECK(restored > 0);  // the draws exercise both paths
    CHECK(lost > 0);
}

TEST_CASE("hybrid slots over an ISWA attention part: checkpoints hold the sliding-window layers too") {
    hyb_iswa_t mem = hybslot_make<hyb_iswa_t>(2);
    kvcache::slot_manager<hyb_iswa_t> slots(mem, {.n_slots = 1, .checkpoint_every = 16});
    const prompt_tokens a = toy::text(40);
    auto r = hybslot_run(slots, mem, a);
    CHECK(mem.attention().window_pos_min(r.seq) > 0);  // the ring pruned positions below its window
    r = hybslot_run(slots, mem, a);  // exact repeat: the checkpoint at 39 brings both parts back
    CHECK(r.n_past == 39);
    CHECK(r.metrics.checkpoint_restored);
    r = hybslot_run(slots, mem, toy::cat(toy::text(20), toy::text(5, 600)));
    CHECK(r.n_past == 16);
    CHECK(r.metrics.miss == kvcache::miss_reason::no_checkpoint);
    CHECK(r.metrics.checkpoint_restored);
}
