// F21: the global prompt cache: radix index against a linear scan, selection rule,
// byte and token limits (0 and 1), eviction orders, pinned entries, tenant salt
// isolation, prefix entries dropped, state round trip (copy and shared stores).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/prompt/state_store.hpp>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "prompt/toy_model.hpp"
#include "support/result_check.hpp"

using kvcache::prompt_tokens;
using kvcache::token_t;
namespace reuse = kvcache::reuse;
using cache_t = kvcache::kv_cache<kvcache::f32, reuse::global<>>;

namespace {

template <class Eviction = reuse::evict_lru, class Store = kvcache::copy_store<cache_t>>
struct fixture {
    cache_t cache{toy::shape(4096, 16)};
    kvcache::prompt_cache<cache_t, Store, Eviction> pc;
    explicit fixture(kvcache::prompt_cache_limits lim = {}, Store st = Store{}) : pc(lim, std::move(st)) {}
    /// Computes p into sequence 0 and saves it.
    std::optional<std::uint64_t> put(const prompt_tokens& p, kvcache::entry_options o = {}) {
        REQUIRE(cache.seq_rm(0, -1, -1));
        toy::fill(cache, 0, p, 0, p.size());
        return pc.save(cache, 0, p, o);
    }
};

using toy::cat;

}  // namespace

TEST_CASE("radix_index: insert, find, erase, prefixes, extensions, node count") {
    kvcache::radix_index ix;
    std::vector<kvcache::key_symbol> a{1, 2, 3, 4}, b{1, 2, 5}, c{1, 2}, d{9};
    CHECK(ix.insert(0, a, 10));
    CHECK(ix.insert(0, b, 11));
    CHECK(!ix.insert(0, a, 12));  // one entry per key
    CHECK(ix.insert(0, c, 13));
    CHECK(ix.insert(7, a, 14));  // other salt: other tree
    CHECK(ix.size() == 4);
    REQUIRE(ix.find(0, a) != nullptr);
    CHECK(*ix.find(0, a) == 10);
    CHECK(*ix.find(7, a) == 14);
    CHECK(ix.find(0, d) == nullptr);
    CHECK(ix.find(0, std::vector<kvcache::key_symbol>{1, 2, 3}) == nullptr);
    CHECK(ix.has_extension(0, std::vector<kvcache::key_symbol>{1, 2, 3}));
    CHECK(!ix.has_extension(0, std::vector<kvcache::key_symbol>{1, 2, 3, 4, 5}));
    CHECK(!ix.has_extension(3, c));
    const auto pre = ix.prefixes_of(0, std::vector<kvcache::key_symbol>{1, 2, 3, 4, 6});
    REQUIRE(pre.size() == 2);
    CHECK(pre[0] == std::pair<std::uint64_t, std::uint32_t>{13, 2});
    CHECK(pre[1] == std::pair<std::uint64_t, std::uint32_t>{10, 4});
    // candidates for [1 2 3 9]: depth 3 (entry a, len 4), depth 2 (entry c, exact prefix)
    std::vector<kvcache::radix_index::candidate> got;
    ix.candidates(0, std::vector<kvcache::key_symbol>{1, 2, 3, 9}, [&](auto cd) {
        got.push_back(cd);
        return true;
    });
    REQUIRE(got.size() == 2);
    CHECK((got[0].id == 10 && got[0].lcp == 3 && got[0].len == 4));
    CHECK((got[1].id == 13 && got[1].lcp == 2 && got[1].len == 2));
    CHECK(ix.erase(0, c));
    CHECK(!ix.erase(0, c));
    got.clear();
    ix.candidates(0, std::vector<kvcache::key_symbol>{1, 2, 7}, [&](auto cd) {
        got.push_back(cd);
        return true;
    });
    REQUIRE(got.size() == 1);
    CHECK((got[0].lcp == 2 && got[0].len == 3 && got[0].id == 11));  // the shorter of a and b
    CHECK(ix.erase(0, a));
    CHECK(ix.erase(0, b));
    CHECK(ix.erase(7, a));
    CHECK(ix.size() == 0);
    CHECK(ix.node_count() == 0);  // every node pruned, empty trees dropped
}

TEST_CASE("prompt_cache: radix selection equals the linear scan on random prompts") {
    const unsigned seed = 4242;
    std::printf("prompt_cache random selection seed %u\n", seed);
    std::mt19937 rng(seed);
    kvcache::model_shape s = toy::shape(64, 4);
    cache_t cache(s);
    kvcache::prompt_cache<cache_t> pc(kvcache::prompt_cache_limits{0, 0});
    std::vector<prompt_tokens> systems;
    for (int i = 0; i < 5; ++i) systems.push_back(toy::text(1 + rng() % 6, static_cast<token_t>(10 * i)));
    auto random_prompt = [&] {
        prompt_tokens p = systems[rng() % systems.size()];
        const int n = static_cast<int>(rng() % 8);
        for (int i = 0; i < n; ++i) {
            if (rng() % 7 == 0)
                p.push_media(rng() % 2, 1 + static_cast<std::uint32_t>(rng() % 2));
            else
                p.push_back(static_cast<token_t>(rng() % 3));
        }
        return p;
    };
    for (int it = 0; it < 4000; ++it) {
        const auto op = rng() % 10;
        if (op < 4) {
            REQUIRE(cache.seq_rm(0, -1, -1));
            const prompt_tokens p = random_prompt();
            toy::fill(cache, 0, p, 0, p.size());
            static_cast<void>(pc.save(cache, 0, p, {rng() % 2}));
        } else if (op < 5 && pc.size() > 0) {
            const auto ids = pc.ids();
            pc.erase(cache, ids[rng() % ids.size()]);
        } else {
            const prompt_tokens req = random_prompt();
            const std::uint64_t salt = rng() % 2;
            const std::size_t slot_len = rng() % 6;
            const std::size_t slot_lcp = slot_len == 0 ? 0 : rng() % (slot_len + 1);
            const auto fast = pc.select(req, salt, slot_lcp, slot_len);
            const auto slow = pc.select_linear(req, salt, slot_lcp, slot_len);
            REQUIRE(fast.has_value() == slow.has_value());
            if (fast) {
                REQUIRE(fast->lcp == slow->lcp);
                REQUIRE(fast->len == slow->len);
                REQUIRE(pc.tokens_of(fast->id)->common_prefix(req) == fast->lcp);
                if (rng() % 4 == 0) {  // move it out: the index must forget it
                    const prompt_tokens t = *pc.tokens_of(fast->id);
                    auto got = pc.load(cache, 1, fast->id);
                    REQUIRE(got.ok());
                    REQUIRE(got.value().tokens == t);
                    REQUIRE(pc.tokens_of(fast->id) == nullptr);
                    REQUIRE(cache.seq_rm(1, -1, -1));
                }
            }
        }
        REQUIRE(pc.index().size() == pc.size());
    }
}

TEST_CASE("prompt_cache: selection rule (f_keep >= 0.25, beats the slot on f_keep and sim, exact prefix)") {
    fixture<> f(kvcache::prompt_cache_limits{0, 0});
    const prompt_tokens base = toy::text(100);
    const auto e1 = f.put(cat(base, toy::text(20, 9000)));  // 120 tokens
    REQUIRE(e1);
    const prompt_tokens req = cat(base, toy::text(5, 7000));  // lcp 100 with e1: f_keep 0.83, sim 0.95
    auto s = f.pc.select(req);
    REQUIRE(s);
    CHECK(s->lcp == 100);
    CHECK(s->len == 120);
    // the slot already holds base exactly: e1 is not better on f_keep (0.83 < 1)
    CHECK(!f.pc.select(req, 0, 100, 100));
    // f_keep below 0.25: entry of 500 tokens sharing 100
    fixture<> g(kvcache::prompt_cache_limits{0, 0});
    REQUIRE(g.put(cat(base, toy::text(400, 9000))));
    CHECK(!g.pc.select(req));
    // an exact prefix longer than the slot's lcp wins even when f_keep ties at 1
    const auto e2 = f.put(cat(base, toy::text(3, 7000)));  // 103 tokens, prefix of req
    REQUIRE(e2);
    s = f.pc.select(req, 0, 100, 100);
    REQUIRE(s);
    CHECK(s->id == *e2);
    CHECK(s->lcp == 103);
    // the longest lcp wins over a shorter exact prefix
    const auto e3 = f.put(cat(cat(base, toy::text(4, 7000)), toy::text(2, 1)));  // lcp 104, len 106
    REQUIRE(e3);
    s = f.pc.select(req);
    REQUIRE(s);
    CHECK(s->id == *e3);
    CHECK(s->lcp == 104);
}

TEST_CASE("prompt_cache: load moves the entry's K/V into the slot bit-exactly") {
    fixture<> f(kvcache::prompt_cache_limits{0, 0});
    prompt_tokens p = toy::text(50);
    p.push_media(99, 4);
    p.push_back(3);
    REQUIRE(f.put(p));
    REQUIRE(f.cache.seq_rm(0, -1, -1));
    CHECK(f.pc.bytes() > 55 * f.cache.bytes_per_token());
    const auto s = f.pc.find(p);
    REQUIRE(s);
    CHECK(s->lcp == 55);
    auto got = f.pc.load(f.cache, 3, s->id);
    REQUIRE(got.ok());
    CHECK(got.value().tokens == p);
    CHECK(toy::max_error(f.cache, 3, p, p.size()) == 0.0);
    CHECK(f.pc.size() == 0);  // moved out
    CHECK(f.pc.bytes() == 0);
    // errors change nothing
    CHECK(f.pc.load(f.cache, 3, s->id).code() == kvcache::errc::invalid_argument);
    REQUIRE(f.put(p));
    const auto id = f.pc.ids().front();
    const auto again = f.pc.load(f.cache, 3, id);  // sequence 3 is not empty
    CHECK(again.code() == kvcache::errc::invalid_argument);
    CHECK(f.pc.size() == 1);
    const auto m = f.pc.metrics();
    CHECK(m.queries == 1);
    CHECK(m.hits == 1);           // loads that succeeded
    CHECK(m.load_failures == 1);  // sequence 3 was not empty (an unknown id is no load)
    CHECK(m.hit_tokens == 0);     // token counters are slot_manager's (it knows what it reused)
    CHECK(m.query_tokens == 0);
    CHECK(m.inserts == 2);
    CHECK(m.entries == 1);
}

TEST_CASE("prompt_cache: saving drops entries that are prefixes, skips prompts already contained") {
    fixture<> f(kvcache::prompt_cache_limits{0, 0});
    const prompt_tokens a = toy::text(10);
    REQUIRE(f.put(a));
    REQUIRE(f.put(cat(a, toy::text(3, 50))));
    CHECK(f.pc.size() == 1);  // a was a prefix of the new entry
    CHECK(f.pc.metrics().removed_prefixes == 1);
    CHECK(!f.put(a));  // contained in the stored entry
    CHECK(f.pc.metrics().skipped == 1);
    CHECK(f.pc.size() == 1);
    // pinned prefixes are kept
    fixture<> g(kvcache::prompt_cache_limits{0, 0});
    REQUIRE(g.put(a, {0, 0, true}));
    REQUIRE(g.put(cat(a, toy::text(3, 50))));
    CHECK(g.pc.size() == 2);
}

TEST_CASE("prompt_cache: limits 0 (none) and 1 (one entry kept), dynamic token limit") {
    SUBCASE("no limits") {
        fixture<> f(kvcache::prompt_cache_limits{0, 0});
        for (int i = 0; i < 20; ++i) REQUIRE(f.put(toy::text(10, 100 * i)));
        CHECK(f.pc.size() == 20);
        CHECK(f.pc.metrics().evictions == 0);
    }
    SUBCASE("byte limit 1: only the newest entry stays") {
        fixture<> f(kvcache::prompt_cache_limits{1, 0});
        for (int i = 0; i < 5; ++i) REQUIRE(f.put(toy::text(10, 100 * i)));
        REQUIRE(f.pc.size() == 1);
        CHECK(*f.pc.tokens_of(f.pc.ids()[0]) == toy::text(10, 400));
        CHECK(f.pc.metrics().evictions == 4);
    }
    SUBCASE("token limit 1 without a byte limit") {
        fixture<> f(kvcache::prompt_cache_limits{0, 1});
        for (int i = 0; i < 3; ++i) REQUIRE(f.put(toy::text(10, 100 * i)));
        CHECK(f.pc.size() == 1);
    }
    SUBCASE("byte limit of three entries") {
        fixture<> probe(kvcache::prompt_cache_limits{0, 0});
        REQUIRE(probe.put(toy::text(10)));
        const std::size_t one = probe.pc.bytes();
        fixture<> f(kvcache::prompt_cache_limits{3 * one, 0});
        for (int i = 0; i < 6; ++i) REQUIRE(f.put(toy::text(10, 100 * i)));
        CHECK(f.pc.size() == 3);
        CHECK(f.pc.bytes() <= 3 * one);
        // the dynamic token limit is max(limit_tokens, limit_bytes / bytes per token): here the
        // byte-derived limit (30 tokens) wins over limit_tokens = 5
        f.pc.set_limits(f.cache, {3 * one, 5});
        CHECK(f.pc.size() == 3);
        f.pc.set_limits(f.cache, {0, 5});  // without a byte limit the token limit applies directly
        CHECK(f.pc.size() == 1);
    }
}

TEST_CASE_TEMPLATE("prompt_cache: eviction order", E, reuse::evict_lru, reuse::evict_lfu, reuse::evict_priority) {
    fixture<E> probe(kvcache::prompt_cache_limits{0, 0});
    REQUIRE(probe.put(toy::text(10)));
    const std::size_t one = probe.pc.bytes();
    fixture<E> f(kvcache::prompt_cache_limits{3 * one, 0});
    const auto a = f.put(toy::text(10, 0), {0, 5, false, 3});  // priority 5, 3 earlier hits
    const auto b = f.put(toy::text(10, 100), {0, 1, false, 0});
    const auto c = f.put(toy::text(10, 200), {0, 9, false, 1});
    REQUIRE((a && b && c));
    REQUIRE(f.put(toy::text(10, 300), {0, 7, false, 2}));  // over the limit: one eviction
    REQUIRE(f.pc.size() == 3);
    std::uint64_t gone = 0;
    for (auto id : {*a, *b, *c})
        if (f.pc.tokens_of(id) == nullptr) gone = id;
    if constexpr (std::is_same_v<E, reuse::evict_lru>) CHECK(gone == *a);       // oldest
    if constexpr (std::is_same_v<E, reuse::evict_lfu>) CHECK(gone == *b);       // fewest hits
    if constexpr (std::is_same_v<E, reuse::evict_priority>) CHECK(gone == *b);  // lowest priority
}

TEST_CASE("prompt_cache: pinned entries survive pressure") {
    fixture<> probe(kvcache::prompt_cache_limits{0, 0});
    REQUIRE(probe.put(toy::text(10)));
    const std::size_t one = probe.pc.bytes();
    fixture<> f(kvcache::prompt_cache_limits{2 * one, 0});
    const auto pinned = f.put(toy::text(10, 0), {0, 0, true});
    REQUIRE(pinned);
    for (int i = 1; i < 10; ++i) REQUIRE(f.put(toy::text(10, 100 * i)));
    CHECK(f.pc.size() == 2);
    CHECK(f.pc.tokens_of(*pinned) != nullptr);
    // when only pinned entries are left, the limit cannot be met and nothing breaks
    f.pc.set_pinned(f.cache, f.pc.ids()[0] == *pinned ? f.pc.ids()[1] : f.pc.ids()[0], true);
    f.pc.set_limits(f.cache, {1, 0});
    CHECK(f.pc.size() == 2);
    CHECK(!f.pc.evict_one(f.cache));
}

TEST_CASE("prompt_cache: tenant salt isolation") {
    fixture<> f(kvcache::prompt_cache_limits{0, 0});
    const prompt_tokens p = toy::text(40);
    REQUIRE(f.put(p, {1}));
    CHECK(f.pc.select(p, 1));
    CHECK(!f.pc.select(p, 2));
    CHECK(!f.pc.select(p, 0));
    CHECK(!f.pc.select_linear(p, 2));
    REQUIRE(f.put(p, {2}));  // same tokens, other tenant: a separate entry
    CHECK(f.pc.size() == 2);
}

TEST_CASE("prompt_cache: a hit after the eviction of a parent entry returns the child's own state") {
    fixture<> probe(kvcache::prompt_cache_limits{0, 0});
    REQUIRE(probe.put(toy::text(30)));
    fixture<> f(kvcache::prompt_cache_limits{0, 0});
    const prompt_tokens parent = toy::text(30);
    const prompt_tokens child_a = cat(parent, toy::text(10, 500));
    const prompt_tokens child_b = cat(parent, toy::text(12, 900));
    const auto pid = f.put(parent, {0, 0, true});  // pinned, so the children do not replace it
    REQUIRE(f.put(child_a));
    REQUIRE(f.put(child_b));
    f.pc.set_pinned(f.cache, *pid, false);
    REQUIRE(f.pc.erase(f.cache, *pid));  // the parent goes: tree nodes are merged
    const auto s = f.pc.select(cat(child_a, toy::text(2, 7)));
    REQUIRE(s);
    CHECK(s->lcp == 40);
    REQUIRE(f.cache.seq_rm(1, -1, -1));
    auto got = f.pc.load(f.cache, 1, s->id);
    REQUIRE(got.ok());
    CHECK(got.value().tokens == child_a);
    CHECK(toy::max_error(f.cache, 1, child_a, child_a.size()) == 0.0);
}

TEST_CASE("prompt_cache: shared_store shares cells instead of copying") {
    using store = kvcache::shared_store<cache_t>;
    fixture<reuse::evict_lru, store> f(kvcache::prompt_cache_limits{0, 0}, store(8, 2));
    const prompt_tokens p = toy::text(64);
    REQUIRE(f.put(p));
    CHECK(f.cache.used() == 64);  // no copy: the entry shares sequence 0's cells
    CHECK(f.pc.bytes() == 64 * f.cache.bytes_per_token());
    REQUIRE(f.put(toy::text(8, 700)));
    CHECK(f.pc.store().n_free() == 0);
    REQUIRE(f.put(toy::text(8, 900)));  // no reserved id left: the LRU entry is evicted
    CHECK(f.pc.size() == 2);
    CHECK(f.pc.metrics().evictions == 1);
    REQUIRE(f.cache.seq_rm(0, -1, -1));
    const prompt_tokens q = toy::text(8, 700);
    const auto s = f.pc.select(q);
    REQUIRE(s);
    auto got = f.pc.load(f.cache, 3, s->id);
    REQUIRE(got.ok());
    CHECK(toy::max_error(f.cache, 3, q, q.size()) == 0.0);
    CHECK_THROWS_AS(store(-1, 2), kvcache::error);
}

TEST_CASE("prompt_cache: a loaded shared_store entry's checkpoints move to the caller, still valid") {
    using store = kvcache::shared_store<cache_t>;
    fixture<reuse::evict_lru, store> f(kvcache::prompt_cache_limits{0, 0}, store(8, 4));
    const prompt_tokens p = toy::text(40);
    toy::fill(f.cache, 0, p, 0, 20);
    auto ck = f.pc.store().save(f.cache, 0);  // a checkpoint at 20 positions: a reserved sequence
    REQUIRE(ck.ok());
    toy::fill(f.cache, 0, p, 20, p.size());
    std::vector<kvcache::swa_checkpoint<store::handle>> cks{{0, 19, ck.value()}};
    const auto id = f.pc.save(f.cache, 0, p, {}, std::move(cks));
    REQUIRE(id);
    auto got = f.pc.load(f.cache, 1, *id);
    REQUIRE(got.ok());
    REQUIRE(got.value().checkpoints.size() == 1);
    const auto& h = got.value().checkpoints[0].state;
    CHECK(f.pc.store().valid(f.cache, h));  // not released by the load
    CHECK(f.cache.seq_pos_max(h.seq) == 19);
    CHECK(toy::max_error(f.cache, h.seq, p, 20) == 0.0);
    CHECK(f.pc.store().n_free() == 3);  // the entry's own sequence went back, the checkpoint's did not
}

TEST_CASE("prompt_cache: state_store keeps io::save_seq bytes and loads them with io::load_seq") {
    using store = kvcache::state_store<cache_t>;
    fixture<reuse::evict_lru, store> f(kvcache::prompt_cache_limits{0, 0});
    prompt_tokens p = toy::text(30);
    p.push_media(5, 3);
    p.push_back(1);
    REQUIRE(f.put(p));
    CHECK(f.pc.bytes() > 34 * f.cache.bytes_per_token());
    REQUIRE(f.cache.seq_rm(0, -1, -1));
    const auto s = f.pc.select(p);
    REQUIRE(s);
    auto got = f.pc.load(f.cache, 2, s->id);
    REQUIRE(got.ok());
    CHECK(got.value().tokens == p);
    CHECK(toy::max_error(f.cache, 2, p, p.size()) == 0.0);
    REQUIRE(f.put(p));
    const auto again = f.pc.load(f.cache, 2, f.pc.ids().front());  // destination not empty
    CHECK(again.code() == kvcache::errc::invalid_argument);
    CHECK(f.pc.size() == 1);
}

TEST_CASE("copy_store: fragmented cells, f16 and transposed V round-trip bit-exactly") {
    using vt_cache = kvcache::kv_cache<kvcache::f16, kvcache::contiguous<kvcache::v_layout::transposed>>;
    vt_cache cache(toy::shape(256, 4));
    const prompt_tokens a = toy::text(45, 0), b = toy::text(45, 900);
    for (std::size_t i = 0; i < a.size(); ++i) {  // interleave two sequences: runs of 1-3 cells
        toy::fill(cache, 0, a, i, i + 1);
        if (i % 3 == 0) toy::fill(cache, 1, b, i / 3, i / 3 + 1);
    }
    auto rows_of = [&](kvcache::seq_id_t s) {
        std::vector<float> out, row(cache.shape().k_row_size());
        for (kvcache::pos_t p = 0; p < static_cast<kvcache::pos_t>(a.size()); ++p) {
            const long c = toy::cell_of(cache, s, p);
            REQUIRE(c >= 0);
            for (std::uint32_t l = 0; l < cache.shape().n_layer; ++l) {
                cache.read_k(l, static_cast<std::uint32_t>(c), row.data());
                out.insert(out.end(), row.begin(), row.end());
                cache.read_v(l, static_cast<std::uint32_t>(c), row.data());
                out.insert(out.end(), row.begin(), row.end());
            }
        }
        return out;
    };
    const auto before = rows_of(0);
    kvcache::copy_store<vt_cache> st;
    auto h = st.save(cache, 0);
    REQUIRE(h.ok());
    REQUIRE(cache.seq_rm(0, -1, -1));
    toy::fill(cache, 3, b, 0, 7);  // the load lands in other (fragmented) cells
    REQUIRE(st.load(cache, 2, h.value()).ok());
    CHECK(rows_of(2) == before);
    CHECK(st.load(cache, 2, h.value()).code() == kvcache::errc::invalid_argument);  // dst not empty
}
