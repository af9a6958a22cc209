// F19-F24 through the host entry point: slot_manager::prepare / commit_prompt /
// append / release, driven like a host engine with the toy model. After every
// request the slot's whole sequence is checked against a fresh computation.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "prompt/toy_model.hpp"
#include "support/memory_snapshot.hpp"
#include "support/result_check.hpp"

using kvcache::prompt_tokens;
using kvcache::request_options;
using kvcache::token_t;
namespace reuse = kvcache::reuse;

namespace {

using toy::cat;

/// One request as a host engine runs it: prepare, compute the rest, n_gen generated tokens, release.
template <class Slots, class Cache>
kvcache::prepared_request run(Slots& slots, Cache& cache, const prompt_tokens& req, request_options ro = {},
                              int n_gen = 1, bool context_free = false) {
    auto p = slots.prepare(req, ro).value();
    REQUIRE(p.n_past <= p.n_request);
    REQUIRE(p.metrics.hit_tokens() + p.metrics.computed == req.size());
    toy::fill(cache, p.seq, req, p.n_past, p.n_request, context_free);
    slots.commit_prompt(p.slot);
    for (int g = 0; g < n_gen; ++g) {
        const token_t t = 90000 + g;
        prompt_tokens next = slots.tokens(p.slot);
        next.push_back(t);
        toy::fill(cache, p.seq, next, next.size() - 1, next.size(), context_free);
        slots.append(p.slot, t);
    }
    const auto& held = slots.tokens(p.slot);
    const double err = toy::max_error(cache, p.seq, held, held.size(), context_free);
    if (context_free)
        REQUIRE(err < 1e-5);
    else
        REQUIRE(err == 0.0);
    REQUIRE(cache.seq_pos_max(p.seq) == static_cast<kvcache::pos_t>(held.size()) - 1);
    slots.release(p.slot);
    return p;
}

}  // namespace

TEST_CASE("slots F24: exact repeat computes one token; a prompt growing by 3 tokens computes 3 every round") {
    using cache_t = kvcache::kv_cache<reuse::global<>>;
    cache_t cache(toy::shape(4096));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens base = toy::text(1000);

    auto r1 = run(slots, cache, base);
    CHECK(r1.metrics.computed == 1000);
    auto r2 = run(slots, cache, base);
    CHECK(r2.metrics.computed == 1);  // recomputed for logits
    CHECK(r2.metrics.from_slot == 999);

    prompt_tokens req = base;
    for (int round = 0; round < 4; ++round) {
        req.append(toy::text(3, 50000 + 10 * round).tokens());
        const auto r = run(slots, cache, req);
        CHECK(r.metrics.computed == 3);
        CHECK(r.metrics.from_slot == req.size() - 3);
    }
    CHECK(slots.metrics().queries == 6);  // every request looked at the global cache
}

TEST_CASE("slots: multi-turn keeps the generated tokens; cache_prompt = false and reuse::none recompute all") {
    using cache_t = kvcache::kv_cache<reuse::lcp>;
    cache_t cache(toy::shape(1024));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens turn1 = toy::text(100);
    run(slots, cache, turn1, {}, 5);
    prompt_tokens turn2 = slots.tokens(0);  // the history, generated tokens included
    CHECK(turn2.size() == 105);
    turn2.append(toy::text(20, 7000).tokens());
    CHECK(run(slots, cache, turn2).metrics.computed == 20);
    CHECK(run(slots, cache, turn2, {.cache_prompt = false}).metrics.computed == 125);

    using none_t = kvcache::kv_cache<>;
    none_t c2(toy::shape(1024));
    kvcache::slot_manager<none_t> s2(c2, {.n_slots = 1});
    run(s2, c2, turn1);
    CHECK(run(s2, c2, turn1).metrics.computed == 100);
}

TEST_CASE("slots F22: longest prefix above the threshold, else least recently used idle slot; explicit id") {
    using cache_t = kvcache::kv_cache<reuse::lcp>;
    cache_t cache(toy::shape(2048));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 3, .first_seq = 1});
    const prompt_tokens a = toy::text(100, 0), b = toy::text(100, 1000), c = toy::text(100, 2000);
    CHECK(run(slots, cache, a).slot == 0);  // all empty: LRU = slot 0
    CHECK(run(slots, cache, b).slot == 1);
    CHECK(run(slots, cache, c).slot == 2);
    CHECK(slots.seq_of(2) == 3);
    auto r = run(slots, cache, cat(b, toy::text(5, 9)));  // prefix match on slot 1
    CHECK(r.slot == 1);
    CHECK(r.metrics.computed == 5);
    // below the similarity threshold (0.1): 5 shared tokens of 100 -> LRU slot (slot 0)
    r = run(slots, cache, cat(toy::text(5, 2000), toy::text(95, 40000)));
    CHECK(r.slot == 0);
    CHECK(r.metrics.computed == 100);
    // explicit slot id is honoured even without a prefix
    r = run(slots, cache, a, {.slot_id = 2});
    CHECK(r.slot == 2);
    // busy slots are skipped; explicit busy / bad ids and all-busy are errors
    auto p0 = slots.prepare(a).value();
    CHECK(slots.busy(p0.slot));
    CHECK_THROWS_WITH_AS(static_cast<void>(slots.prepare(a, {.slot_id = p0.slot})),
                         doctest::Contains("is busy"), kvcache::error);
    CHECK_THROWS_WITH_AS(static_cast<void>(slots.prepare(a, {.slot_id = 3})),
                         doctest::Contains("slot = 3"), kvcache::error);
    auto p1 = slots.prepare(a).value();
    auto p2 = slots.prepare(a).value();
    CHECK(p1.slot != p0.slot);
    CHECK(p2.slot != p1.slot);
    {  // every slot busy: an expected condition, a no_space result (the host waits), nothing changed
        const auto used = cache.used();
        const auto busy = slots.prepare(a);
        CHECK(kvtest::refused_with(busy, kvcache::errc::no_space, "every one of the 3 slots is busy"));
        CHECK(cache.used() == used);
        CHECK(slots.busy(p0.slot));
    }
    CHECK_THROWS_WITH_AS(static_cast<void>(slots.prepare(prompt_tokens{})),
                         doctest::Contains("no tokens"), kvcache::error);
    // commit_prompt before the host computed everything is refused
    CHECK_THROWS_WITH_AS(slots.commit_prompt(p0.slot), doctest::Contains("the request needs 99"), kvcache::error);
    CHECK_THROWS_WITH_AS(slots.append(p0.slot, 5), doctest::Contains("not generating"), kvcache::error);
    // a request abandoned half-way: release drops the uncommitted positions
    toy::fill(cache, p0.seq, a, p0.n_past, p0.n_request);
    for (const auto& p : {p0, p1, p2}) slots.release(p.slot);
    CHECK(cache.seq_pos_max(p0.seq) == static_cast<kvcache::pos_t>(slots.tokens(p0.slot).size()) - 1);
    CHECK_THROWS_AS(kvcache::slot_manager<cache_t>(cache, {.n_slots = 8, .first_seq = 1}), kvcache::error);
    CHECK_THROWS_AS(kvcache::slot_manager<cache_t>(cache, {.n_slots = 0}), kvcache::error);
}

TEST_CASE("slots F21: two slots and the global cache; a hit loads another slot's released state") {
    using cache_t = kvcache::kv_cache<reuse::global<>>;
    cache_t cache(toy::shape(4096));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 2});
    const prompt_tokens a = toy::text(300, 0), b = toy::text(200, 5000);
    run(slots, cache, a, {.slot_id = 0});
    run(slots, cache, b, {.slot_id = 1});
    CHECK(slots.global_cache().size() == 2);
    // slot 1 holds b; the request extends a: the entry saved from slot 0 is loaded into slot 1
    const auto r = run(slots, cache, cat(a, toy::text(4, 77)), {.slot_id = 1});
    CHECK(r.metrics.from_global == 300);
    CHECK(r.metrics.computed == 4);
    CHECK(slots.metrics().hits == 1);
    CHECK(slots.metrics().hit_tokens == 300);
}

TEST_CASE("slots: tenant salt isolation in slots and the global cache") {
    using cache_t = kvcache::kv_cache<reuse::global<>>;
    cache_t cache(toy::shape(4096));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 2});
    const prompt_tokens p = toy::text(200);
    run(slots, cache, p, {.salt = 1});
    CHECK(run(slots, cache, p, {.salt = 2}).metrics.computed == 200);  // never tenant 1's state
    // slot 0 holds tenant 1's state: tenant 2 may only use its own global entry
    auto r = run(slots, cache, p, {.slot_id = 0, .salt = 2});
    CHECK(r.metrics.from_slot == 0);
    CHECK(r.metrics.from_global == 199);
    r = run(slots, cache, p, {.salt = 1});  // both slots now hold tenant 2: tenant 1's entry is used
    CHECK(r.metrics.from_global == 199);
    CHECK(r.metrics.computed == 1);
}

TEST_CASE("slots F20: chunk_shift moves a >= 32-token chunk into place") {
    using cache_t = kvcache::kv_cache<reuse::chunk_shift<32>>;
    cache_t cache(toy::shape(1024));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens A = toy::text(100, 0), X = toy::text(10, 500), B = toy::text(40, 1000);
    run(slots, cache, cat(cat(A, X), B), {}, 0, true);
    const auto r = run(slots, cache, cat(cat(A, B), toy::text(5, 3000)), {}, 1, true);
    CHECK(r.metrics.from_slot == 100);
    CHECK(r.metrics.from_shift == 40);
    CHECK(r.metrics.computed == 5);
    CHECK(!cache.has_shift());  // prepare applied the K-shift
    // A storage tier holding more than the chunk plan gives replaces the plan.
    kvcache::tier::tier_cache<cache_t, kvcache::tier::memory_tier> tiers({.block_tokens = 16}, kvcache::tier::memory_tier());
    kvcache::slot_manager<cache_t> other(cache, {.n_slots = 1, .first_seq = 1});
    other.attach_tiers(tiers, {.scratch_seq = 7});
    const prompt_tokens R = cat(cat(A, B), toy::text(5, 3000));
    CHECK(run(other, cache, R, {}, 0, true).n_past == 0);  // published on release
    slots.attach_tiers(tiers, {.scratch_seq = 6});
    CHECK(run(slots, cache, cat(cat(A, X), B), {}, 0, true).metrics.from_tier == 0);  // keys of R only at 144
    const auto t = run(slots, cache, R, {.slot_id = 0}, 0, true);
    CHECK(t.n_past == 144);      // the plan gave 100 + 40 shifted, the tier 144
    CHECK(t.metrics.from_slot == 100);
    CHECK(t.metrics.from_shift == 0);
    CHECK(t.metrics.from_tier == 44);
    CHECK(!t.k_shift_pending);
    CHECK(t.plan.moves.empty());
    CHECK(slots.metrics().hit_tokens_tier == 44);
}

TEST_CASE("slots F23: SWA checkpoints: restore the newest at or below n_past, else recompute") {
    using cache_t = kvcache::kv_cache<reuse::lcp>;
    cache_t cache(toy::shape(1024));
    const std::uint32_t w = 8;
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1, .n_swa = w});
    const prompt_tokens p = toy::text(40), q = cat(toy::text(30), toy::text(10, 7000));
    // first request: compute [0, 20), checkpoint, compute [20, 40); a ring buffer then
    // keeps only the last w positions (simulated with seq_rm)
    auto r = slots.prepare(p).value();
    toy::fill(cache, r.seq, p, 0, 20);
    REQUIRE(slots.save_checkpoint(r.slot));
    REQUIRE(cache.seq_rm(r.seq, 0, 20 - w));
    toy::fill(cache, r.seq, p, 20, 40);
    REQUIRE(cache.seq_rm(r.seq, 0, 40 - w));
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    CHECK(slots.n_checkpoints(0) == 1);
    // q shares 30 tokens, but positions below 32 are gone: continue from the checkpoint at 19
    r = slots.prepare(q).value();
    CHECK(r.metrics.checkpoint_restored);
    CHECK(r.n_past == 20);
    CHECK(r.metrics.computed == 20);
    CHECK(toy::max_error(cache, r.seq, q, 20) == 0.0);
    toy::fill(cache, r.seq, q, 20, 40);
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    // no usable checkpoint (the one at 19 is above n_past = 10): recompute everything
    slots.clear_slot(0);
    run(slots, cache, p);
    REQUIRE(cache.seq_rm(0, 0, 40 - w));  // window moved on
    r = slots.prepare(cat(toy::text(10), toy::text(5, 123))).value();
    CHECK(!r.metrics.checkpoint_restored);
    CHECK(r.n_past == 0);
    slots.release(r.slot);
}

TEST_CASE("slots: shared_store global cache shares cells with the slot instead of copying") {
    using cache_t = kvcache::kv_cache<reuse::global<reuse::lcp, reuse::evict_lru>>;
    using store = kvcache::shared_store<cache_t>;
    cache_t cache(toy::shape(2048, 16));
    kvcache::slot_manager<cache_t, store> slots(cache, {.n_slots = 2}, store(2, 14));
    const prompt_tokens a = toy::text(300, 0);
    run(slots, cache, a, {.slot_id = 0});
    CHECK(cache.used() == 301);  // the entry shares slot 0's cells
    const auto r = run(slots, cache, cat(a, toy::text(3, 9)), {.slot_id = 1});
    CHECK(r.metrics.from_global == 300);
    CHECK(r.metrics.computed == 3);
    CHECK(cache.used() == 301 + 4);  // slot 1 added only its own new cells
    // Storage tiers need a scratch sequence the entry store does not reserve.
    kvcache::tier::tier_cache<cache_t, kvcache::tier::memory_tier> tiers({}, kvcache::tier::memory_tier());
    CHECK_THROWS_WITH_AS(slots.attach_tiers(tiers, {.scratch_seq = 5}), doctest::Contains("reserved by the entry store"),
                         kvcache::error);
    CHECK_FALSE(slots.has_tiers());
}

TEST_CASE("slots: paged layout: a shared_store hit shares blocks, a copy_store hit copies them") {
    using paged_t = kvcache::kv_cache<kvcache::paged<32>, reuse::global<>>;
    const prompt_tokens a = toy::text(320, 0);
    auto shared_blocks = [](const paged_t& c, kvcache::seq_id_t s, kvcache::seq_id_t t) {
        const auto x = c.storage().block_table(s), y = c.storage().block_table(t);
        std::size_t n = 0;
        for (auto b : x) n += static_cast<std::size_t>(std::count(y.begin(), y.end(), b));
        return n;
    };
    SUBCASE("shared_store") {
        using store = kvcache::shared_store<paged_t>;
        paged_t cache(toy::shape(2048, 16));
        kvcache::slot_manager<paged_t, store> slots(cache, {.n_slots = 2}, store(2, 14));
        run(slots, cache, a, {.slot_id = 0});
        const auto r = run(slots, cache, cat(a, toy::text(3, 9)), {.slot_id = 1});
        CHECK(r.metrics.from_global == 320);
        CHECK(shared_blocks(cache, 0, 1) >= 10);  // positions [0, 320): 10 blocks, shared not copied
    }
    SUBCASE("copy_store") {
        paged_t cache(toy::shape(2048, 16));
        kvcache::slot_manager<paged_t> slots(cache, {.n_slots = 2});
        run(slots, cache, a, {.slot_id = 0});
        const auto r = run(slots, cache, cat(a, toy::text(3, 9)), {.slot_id = 1});
        CHECK(r.metrics.from_global == 320);
        CHECK(shared_blocks(cache, 0, 1) == 0);
    }
}

TEST_CASE("slots F23 on the ring layout: the window is really gone, the checkpoint brings it back") {
    constexpr std::uint32_t w = 8;
    using ring_t = kvcache::kv_cache<kvcache::ring<w>, reuse::lcp>;
    ring_t cache(toy::shape(kvcache::ring<w>::cells_for(2, 64), 2));
    kvcache::slot_manager<ring_t> slots(cache, {.n_slots = 1, .n_swa = w});
    const prompt_tokens p = toy::text(40), q = cat(toy::text(30), toy::text(10, 7000));
    auto r = slots.prepare(p).value();
    toy::fill(cache, r.seq, p, 0, 20);
    REQUIRE(slots.save_checkpoint(r.slot));  // the ring holds positions [12, 20)
    toy::fill(cache, r.seq, p, 20, 40);
    CHECK(cache.seq_pos_min(r.seq) == 40 - static_cast<kvcache::pos_t>(w));  // pruned by the layout
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    r = slots.prepare(q).value();
    CHECK(r.metrics.checkpoint_restored);
    CHECK(r.n_past == 20);
    CHECK(toy::max_error(cache, r.seq, q, 20, false, 20 - w) == 0.0);
    toy::fill(cache, r.seq, q, 20, 40);
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    // an exact repeat re-enters at position 39 (its query sees (31, 39], all held): no
    // checkpoint needed
    r = slots.prepare(q).value();
    CHECK_FALSE(r.metrics.checkpoint_restored);
    CHECK(r.n_past == 39);
    CHECK(toy::max_error(cache, r.seq, q, 39, false, 39 - w + 1) == 0.0);
    slots.release(r.slot);
    CHECK(cache.seq_pos_max(r.seq) == 38);  // release dropped nothing the host computed: it computed nothing
    // a request diverging at 38 cannot re-enter there (its query needs position 31, gone):
    // the checkpoint at 19 is the newest usable one
    r = slots.prepare(cat(cat(toy::text(30), toy::text(8, 7000)), toy::text(2, 9000))).value();
    CHECK(r.metrics.checkpoint_restored);
    CHECK(r.n_past == 20);
    slots.release(r.slot);
}

TEST_CASE("slots: paged layout: idle slot states are evicted to make room, counting blocks (issue 25, 5)") {
    using paged_t = kvcache::kv_cache<kvcache::paged<32>, reuse::global<>>;
    const prompt_tokens a = toy::text(64, 1000), b = toy::text(64, 3000), c = toy::text(32, 5000);
    SUBCASE("LRU idle slot first; the slot being prepared and the later idle slot keep theirs") {
        paged_t cache(toy::shape(128, 16));  // 4 blocks of 32 cells
        kvcache::slot_manager<paged_t> slots(cache, {.n_slots = 3});
        run(slots, cache, a, {.slot_id = 0}, 0);  // 2 blocks, idle
        run(slots, cache, b, {.slot_id = 1}, 0);  // 2 blocks, idle, used later
        REQUIRE(cache.storage().free_blocks() == 0);
        const auto p = slots.prepare(c, {.slot_id = 2}).value();  // needs 1 block
        CHECK(slots.tokens(0).empty());
        CHECK(cache.seq_pos_max(0) == -1);
        CHECK(slots.tokens(1).size() == 64);
        CHECK(toy::max_error(cache, 1, b, 64) == 0.0);
        CHECK(slots.metrics().slot_states_evicted == 1);
        CHECK(slots.metrics().room_refused == 0);
        toy::fill(cache, p.seq, c, 0, c.size());  // placed
        slots.commit_prompt(p.slot);
        CHECK(toy::max_error(cache, p.seq, c, c.size()) == 0.0);
    }
    SUBCASE("shared_store: an entry and the idle slot it shares blocks with are both evicted") {
        using store = kvcache::shared_store<paged_t>;
        paged_t cache(toy::shape(128, 16));
        kvcache::slot_manager<paged_t, store> slots(cache, {.n_slots = 3}, store(3, 13));
        run(slots, cache, a, {.slot_id = 0}, 0);  // 2 blocks, shared by slot 0 and its entry
        REQUIRE(slots.global_cache().size() == 1);
        const auto active = slots.prepare(b, {.slot_id = 1}).value();
        toy::fill(cache, active.seq, b, 0, b.size());
        slots.commit_prompt(active.slot);
        REQUIRE(cache.storage().free_blocks() == 0);
        const auto p = slots.prepare(c, {.slot_id = 2}).value();  // evicting either alone frees nothing
        CHECK(slots.global_cache().size() == 0);
        CHECK(slots.tokens(0).empty());
        CHECK(slots.metrics().evictions == 1);
        CHECK(slots.metrics().slot_states_evicted == 1);
        CHECK(cache.storage().free_blocks() == 2);
        toy::fill(cache, p.seq, c, 0, c.size());
        CHECK(toy::max_error(cache, active.seq, b, b.size()) == 0.0);
    }
    SUBCASE("a busy slot is never evicted; complete or nothing when even every idle state is not enough") {
        paged_t cache(toy::shape(128, 16));
        kvcache::slot_manager<paged_t> slots(cache, {.n_slots = 3});
        run(slots, cache, a, {.slot_id = 0}, 0);  // 2 blocks, idle
        const auto active = slots.prepare(b, {.slot_id = 1}).value();
        toy::fill(cache, active.seq, b, 0, b.size());  // 2 blocks, busy (generating)
        slots.commit_prompt(active.slot);
        REQUIRE(cache.storage().free_blocks() == 0);
        // 96 positions need 3 blocks: the idle slot 0 frees 2, slot 1 is busy. Nothing is evicted.
        const kvcache::prompt_tokens big = toy::text(96, 7000);
        const kvtest::snap before = kvtest::snapshot(cache);
        auto p = slots.prepare(big, {.slot_id = 2}).value();
        CHECK(kvtest::first_diff(before, kvtest::snapshot(cache)) == "");
        CHECK(slots.tokens(0).size() == 64);
        CHECK(slots.metrics().slot_states_evicted == 0);
        CHECK(slots.metrics().room_refused == 1);
        std::vector<kvcache::pos_t> pos(96);
        for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<kvcache::pos_t>(i);
        const std::vector<kvcache::seq_id_t> seqs(pos.size(), p.seq);
        {
            const auto placed = cache.place(pos, seqs);  // the host's placement meets no_space
            REQUIRE(!placed);
            CHECK(placed.code() == kvcache::errc::no_space);
        }
        CHECK(kvtest::snapshot(cache) == before);
        slots.release(p.slot);
        // 32 positions fit once slot 0 is evicted; the active slot keeps every cell.
        p = slots.prepare(c, {.slot_id = 2}).value();
        CHECK(slots.metrics().slot_states_evicted == 1);
        CHECK(slots.tokens(0).empty());
        toy::fill(cache, p.seq, c, 0, c.size());
        CHECK(toy::max_error(cache, active.seq, b, b.size()) == 0.0);
        prompt_tokens next = b;
        next.push_back(90000);
        toy::fill(cache, active.seq, next, 64, 65);  // the active slot still generates (a free block is left)
        slots.append(active.slot, 90000);
        CHECK(toy::max_error(cache, active.seq, next, next.size()) == 0.0);
    }
}
