// The reuse contract (kvcache::reuse_policy): the built-in policies' plans, the
// slot manager executing exactly the plans of a custom policy, and plans that
// claim more than the tokens allow being refused with the cache unchanged.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "prompt/toy_model.hpp"
#include "support/cache_snapshot.hpp"

using kvcache::prompt_tokens;
using kvcache::token_t;
namespace reuse = kvcache::reuse;

namespace {

prompt_tokens text(std::initializer_list<std::pair<token_t, int>> runs) {
    std::vector<token_t> t;
    for (auto [first, n] : runs)
        for (int i = 0; i < n; ++i) t.push_back(first + i);
    return prompt_tokens(std::span<const token_t>(t));
}

reuse::plan mk(std::uint32_t n_lcp, std::uint32_t n_past, std::uint32_t n_request) {
    reuse::plan p;
    p.n_lcp = n_lcp;
    p.n_past = n_past;
    p.n_request = n_request;
    return p;
}

/// Reuses the LCP on odd-numbered plans only; records every plan.
struct alternate {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "alternate";
    static constexpr bool needs_shift = false;
    static constexpr bool global_cache = false;
    std::uint32_t n = 0;
    std::vector<reuse::plan> planned;
    reuse::plan plan(const prompt_tokens& cached, const prompt_tokens& request, const reuse::plan_options& opt) {
        reuse::plan p = n++ % 2 == 1 ? reuse::lcp::plan(cached, request, opt) : reuse::none::plan(cached, request, opt);
        planned.push_back(p);
        return p;
    }
};

/// Returns whatever the test sets: a policy that may lie.
template <bool Shift>
struct scripted {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "scripted";
    static constexpr bool needs_shift = Shift;
    static constexpr bool global_cache = false;
    std::function<reuse::plan(const prompt_tokens&, const prompt_tokens&, const reuse::plan_options&)> f;
    reuse::plan plan(const prompt_tokens& cached, const prompt_tokens& request, const reuse::plan_options& opt) {
        return f ? f(cached, request, opt) : reuse::chunk_shift<4>::plan(cached, request, opt);
    }
};

struct no_plan {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "no_plan";
    static constexpr bool needs_shift = false;
    static constexpr bool global_cache = false;
};
struct global_without_eviction {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "g";
    static constexpr bool needs_shift = false;
    static constexpr bool global_cache = true;
    static reuse::plan plan(const prompt_tokens&, const prompt_tokens&, const reuse::plan_options&) { return {}; }
};
struct plan_returns_int {
    using policy_kind = kvcache::reuse_tag;
    static constexpr std::string_view name = "i";
    static constexpr bool needs_shift = false;
    static constexpr bool global_cache = false;
    static int plan(const prompt_tokens&, const prompt_tokens&, const reuse::plan_options&) { return 0; }
};
struct fixed_layout : kvcache::contiguous<> {
    static constexpr bool can_shift = false;
};

/// One request as a host runs it: prepare, compute the rest, commit, release.
template <class Slots, class Cache>
kvcache::prepared_request serve(Slots& slots, Cache& cache, const prompt_tokens& req,
                                kvcache::request_options ro = {}) {
    auto p = slots.prepare(req, ro).value();
    toy::fill(cache, p.seq, req, p.n_past, p.n_request, true);
    slots.commit_prompt(p.slot);
    REQUIRE(toy::max_error(cache, p.seq, req, req.size(), true) < 1e-5);
    slots.release(p.slot);
    return p;
}

}  // namespace

TEST_CASE("reuse_policy: built-ins conform; missing or wrong members are rejected") {
    static_assert(kvcache::reuse_policy<reuse::none>);
    static_assert(kvcache::reuse_policy<reuse::lcp>);
    static_assert(kvcache::reuse_policy<reuse::chunk_shift<8>>);
    static_assert(kvcache::reuse_policy<reuse::global<>>);
    static_assert(kvcache::reuse_policy<reuse::global<reuse::chunk_shift<4>, reuse::evict_lfu>>);
    static_assert(kvcache::reuse_policy<reuse::global<alternate>>);
    static_assert(kvcache::reuse_policy<alternate>);
    static_assert(!kvcache::reuse_has_plan<no_plan> && !kvcache::reuse_policy<no_plan>);
    static_assert(!kvcache::reuse_has_eviction<global_without_eviction>);
    static_assert(!kvcache::reuse_policy<global_without_eviction>);
    static_assert(!kvcache::reuse_policy<plan_returns_int>);
    static_assert(kvcache::eviction_policy<reuse::evict_priority>);
    static_assert(kvcache::reuse_fits_layout<reuse::chunk_shift<4>, kvcache::contiguous<>>);
    static_assert(kvcache::reuse_fits_layout<reuse::lcp, fixed_layout>);
    static_assert(!kvcache::reuse_fits_layout<reuse::chunk_shift<4>, fixed_layout>);
    static_assert(!kvcache::reuse_fits_layout<reuse::global<reuse::chunk_shift<4>>, fixed_layout>);
    CHECK(true);
}

TEST_CASE("reuse policies: none plans nothing, lcp never moves, chunk_shift<N> moves runs >= N, global = base") {
    const prompt_tokens cached = text({{1, 10}, {500, 3}, {20, 12}});
    const prompt_tokens request = text({{1, 10}, {20, 12}, {900, 2}});
    const reuse::plan_options opt{.min_chunk = 99};  // ignored by every built-in

    const reuse::plan n = reuse::none::plan(cached, request, opt);
    CHECK(n.n_past == 0);
    CHECK(n.n_lcp == 0);
    CHECK(n.moves.empty());
    CHECK(n.n_request == request.size());

    const reuse::plan l = reuse::lcp::plan(cached, request, opt);
    CHECK(l == reuse::make_plan(cached, request, {.min_chunk = 0}));
    CHECK(l.n_past == 10);
    CHECK(l.moves.empty());

    const reuse::plan c = reuse::chunk_shift<4>::plan(cached, request, opt);
    CHECK(c == reuse::make_plan(cached, request, {.min_chunk = 4}));
    REQUIRE(c.moves.size() == 1);
    CHECK(c.moves[0] == reuse::chunk_move{13, 10, 12});
    CHECK(c.n_past == 22);
    CHECK(reuse::chunk_shift<13>::plan(cached, request, opt).moves.empty());
    CHECK(reuse::chunk_shift<4>::plan(cached, request, {.can_shift = false}) == l);
    CHECK(reuse::chunk_shift<4>::plan(cached, request, {.cache_prompt = false}) == n);

    reuse::global<reuse::chunk_shift<4>> g;
    CHECK(g.plan(cached, request, opt) == c);
    for (const auto& p : {n, l, c}) CHECK_NOTHROW(reuse::check_plan(cached, request, p, opt, true, "t"));
}

TEST_CASE("slot_manager executes exactly the custom policy's plans (alternation in from_slot)") {
    using cache_t = kvcache::kv_cache<alternate>;
    cache_t cache(toy::shape(512));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    prompt_tokens req = toy::text(40);
    std::vector<std::uint32_t> from_slot;
    for (int round = 0; round < 6; ++round) {
        req.append(toy::text(3, 60000 + 10 * round).tokens());
        const auto p = serve(slots, cache, req);
        const auto& want = slots.reuse_policy_object().planned.back();
        CHECK(p.plan == want);
        CHECK(p.n_past == want.n_past);
        CHECK(p.metrics.from_slot + p.metrics.from_shift == want.n_past);
        CHECK(p.metrics.computed == req.size() - want.n_past);
        from_slot.push_back(p.metrics.from_slot);
    }
    CHECK(slots.reuse_policy_object().planned.size() == 6);
    // Plans 0, 2, 4 reuse nothing; 1, 3, 5 the previous request (3 tokens shorter).
    CHECK(from_slot == std::vector<std::uint32_t>{0, 43, 0, 49, 0, 55});

    // cache_prompt = false: the policy is not asked and nothing is kept.
    const auto p = serve(slots, cache, req, {.cache_prompt = false});
    CHECK(p.metrics.computed == req.size());
    CHECK(slots.reuse_policy_object().planned.size() == 6);
}

TEST_CASE("reuse::none reuses nothing through the slot manager, even for an exact repeat") {
    using cache_t = kvcache::kv_cache<reuse::none>;
    cache_t cache(toy::shape(512));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 2});
    const prompt_tokens req = toy::text(50);
    for (int round = 0; round < 3; ++round) {
        const auto p = serve(slots, cache, req);
        CHECK(p.n_past == 0);
        CHECK(p.metrics.from_slot == 0);
        CHECK(p.metrics.from_shift == 0);
        CHECK(p.metrics.computed == 50);
        CHECK(p.plan.moves.empty());
    }
}

TEST_CASE("global<custom Base>: the base's plans are executed, from the slot or a global entry") {
    using cache_t = kvcache::kv_cache<reuse::global<alternate>>;
    cache_t cache(toy::shape(1024));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens a = toy::text(60);
    const prompt_tokens b = toy::text(60, 30000);
    auto& base = slots.reuse_policy_object().base_policy();
    CHECK(serve(slots, cache, a).n_past == 0);  // plan 0: nothing
    CHECK(serve(slots, cache, b).n_past == 0);  // plan 1: LCP with a = 0; a goes to the global cache
    const auto p = serve(slots, cache, a);      // plan 2: nothing, although the global entry matches
    CHECK(p.n_past == 0);
    CHECK(p.metrics.from_global == 0);
    const auto q = serve(slots, cache, b);      // plan 3: LCP with the global entry b
    CHECK(q.plan == base.planned.back());
    CHECK(q.metrics.from_global == 59);
    CHECK(base.planned.size() == 4);
}

TEST_CASE("a custom policy with needs_shift = true: its chunk moves are executed") {
    using cache_t = kvcache::kv_cache<scripted<true>>;
    cache_t cache(toy::shape(512));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens doc = toy::text(20, 7000);
    prompt_tokens r1 = text({{1, 8}, {500, 5}});
    r1.append(doc.tokens());
    serve(slots, cache, r1);
    prompt_tokens r2 = text({{1, 8}});
    r2.append(doc.tokens());
    r2.append(text({{800, 4}}).tokens());
    const auto p = serve(slots, cache, r2);
    REQUIRE(p.plan.moves.size() == 1);
    CHECK(p.plan.moves[0] == reuse::chunk_move{13, 8, 20});
    CHECK(p.metrics.from_slot == 8);
    CHECK(p.metrics.from_shift == 20);
    CHECK(p.metrics.computed == 4);
}

TEST_CASE("plans that claim more than the tokens allow are refused before anything changes") {
    using cache_t = kvcache::kv_cache<scripted<false>>;
    cache_t cache(toy::shape(512));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens first = text({{1, 10}, {500, 3}, {20, 12}});
    auto& pol = slots.reuse_policy_object();
    pol.f = reuse::lcp::plan;
    serve(slots, cache, first);
    const prompt_tokens req = text({{1, 10}, {20, 12}, {900, 2}});

    using maker = std::function<reuse::plan(const prompt_tokens&, const prompt_tokens&, const reuse::plan_options&)>;
    const auto lying = [](std::function<void(reuse::plan&)> edit) -> maker {
        return [edit](const prompt_tokens& c, const prompt_tokens& r, const reuse::plan_options& o) {
            reuse::plan p = reuse::make_plan(c, r, {.cache_prompt = o.cache_prompt, .min_chunk = 4});
            edit(p);
            return p;
        };
    };
    const std::vector<std::pair<const char*, maker>> cases = {
        {"moves from a needs_shift = false policy", lying([](reuse::plan&) {})},
        {"n_past beyond the common prefix", lying([](reuse::plan& p) { p = mk(12, 12, 24); })},
        {"n_past != n_lcp", lying([](reuse::plan& p) { p = mk(10, 11, 24); })},
        {"wrong n_request", lying([](reuse::plan& p) { p = mk(10, 10, 23); })},
        {"everything kept (no logits)", lying([](reuse::plan& p) { p = mk(24, 24, 24); })},
    };
    for (const auto& c : cases) {
        const char* what = c.first;
        CAPTURE(what);
        pol.f = c.second;
        const auto before = kvtest::snapshot(cache);
        const prompt_tokens held = slots.tokens(0);
        try {
            (void)slots.prepare(req);
            FAIL("accepted");
        } catch (const kvcache::error& e) {
            CHECK(e.code() == kvcache::errc::invalid_argument);
            CHECK(std::string(e.what()).find("refused reuse plan") != std::string::npos);
            CHECK(std::string(e.what()).find("scripted") != std::string::npos);
        }
        CHECK(kvtest::snapshot(cache) == before);
        CHECK(slots.tokens(0) == held);
        CHECK_FALSE(slots.busy(0));
    }
    pol.f = reuse::lcp::plan;
    CHECK(serve(slots, cache, req).n_past == 10);  // an honest plan still goes through
}

TEST_CASE("check_plan: each rule") {
    const prompt_tokens cached = text({{1, 10}, {500, 3}, {20, 12}});
    const prompt_tokens request = text({{1, 10}, {20, 12}, {900, 2}});
    const reuse::plan good = reuse::make_plan(cached, request, {.min_chunk = 4});
    REQUIRE(good.moves.size() == 1);
    const auto refused = [&](reuse::plan p, reuse::plan_options o = {}, bool may_move = true) {
        try {
            reuse::check_plan(cached, request, p, o, may_move, "t");
        } catch (const kvcache::error& e) {
            return e.code() == kvcache::errc::invalid_argument &&
                   std::string(e.what()).find(": t: refused reuse plan: ") != std::string::npos;
        }
        return false;
    };
    CHECK_NOTHROW(reuse::check_plan(cached, request, good, {}, true, "t"));
    CHECK(refused(good, {}, false));                       // moves, needs_shift = false
    CHECK(refused(good, {.can_shift = false}));            // moves, no shifting allowed
    CHECK(refused(good, {.cache_prompt = false}));         // kept with cache_prompt off
    auto p = good;
    p.moves[0].src = 12;                                   // tokens do not match
    CHECK(refused(p));
    p = good;
    p.moves[0].dst = 9;                                    // gap / overlap with the prefix
    CHECK(refused(p));
    p = good;
    p.moves[0].n = 14;                                     // past the end of cached
    p.n_past = 24;
    CHECK(refused(p));
    p = good;
    p.moves[0].n = 0;
    p.n_past = 10;
    CHECK(refused(p));
    p = good;
    p.moves.push_back({14, 22, 1});                        // source overlaps the previous one
    p.n_past = 23;
    CHECK(refused(p));
    p = good;
    p.n_past = 21;                                         // n_past != n_lcp + moves
    CHECK(refused(p));
    CHECK(refused(mk(11, 11, 24)));
    CHECK(refused(mk(0, 0, 25)));

    // Media: n_past must not end inside a chunk; no moves with media.
    prompt_tokens mc = text({{1, 4}});
    mc.push_media(77, 6);
    prompt_tokens mr = mc;
    mr.append(text({{40, 3}}).tokens());
    CHECK_NOTHROW(reuse::check_plan(mc, mr, mk(10, 10, 13), {}, true, "t"));
    CHECK_THROWS_AS(reuse::check_plan(mc, mr, mk(7, 7, 13), {}, true, "t"),
                    kvcache::error);
    CHECK_NOTHROW(reuse::check_plan(mc, mr, mk(4, 4, 13), {}, true, "t"));
}

TEST_CASE("under a sliding window (n_swa > 0) plans may not move cells: a moving plan is refused") {
    using cache_t = kvcache::kv_cache<scripted<true>>;
    cache_t cache(toy::shape(512));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1, .n_swa = 64});
    auto& pol = slots.reuse_policy_object();
    const prompt_tokens first = text({{1, 10}, {500, 3}, {20, 12}});
    serve(slots, cache, first);
    const prompt_tokens req = text({{1, 10}, {20, 12}, {900, 2}});
    // chunk_shift<4> honours opt.can_shift = false: LCP only.
    pol.f = {};
    const auto before = kvtest::snapshot(cache);
    pol.f = [](const prompt_tokens& c, const prompt_tokens& r, const reuse::plan_options&) {
        return reuse::make_plan(c, r, {.min_chunk = 4});  // ignores can_shift
    };
    CHECK_THROWS_AS((void)slots.prepare(req), kvcache::error);
    CHECK(kvtest::snapshot(cache) == before);
    pol.f = {};
    const auto p = serve(slots, cache, req);
    CHECK(p.plan.moves.empty());
    CHECK(p.n_past == 10);
}
