// Entries that cannot lie, and metrics that mean what they say (issue 25, items 4, 5, 9,
// the slot item of 10): slot states and prompt-cache entries whose cells the host changed
// are dropped, never served; prompt_cache::save checks its key; copy_store restores a
// sequence holding a position twice and never commits the host's staged placements; a
// failed global load keeps the slot's own state; paged + shared_store never wedges;
// hit_tokens is what was really reused; Prometheus text exposition.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "prompt/toy_model.hpp"
#include "support/result_check.hpp"

using kvcache::miss_reason;
using kvcache::prompt_tokens;
using kvcache::request_options;
using kvcache::token_t;
namespace reuse = kvcache::reuse;

namespace {

using toy::cat;

/// One request as a host engine runs it; returns the prepared request. `reused` gets the
/// cells the sequence held right after prepare (what the host did not recompute).
template <class Slots, class Cache>
kvcache::prepared_request run_request(Slots& slots, Cache& cache, const prompt_tokens& req, request_options ro = {},
                              bool context_free = false, std::uint64_t* reused = nullptr) {
    auto p = slots.prepare(req, ro).value();
    REQUIRE(p.metrics.hit_tokens() + p.metrics.computed == req.size());
    if (reused != nullptr) *reused += cache.cells().seq_cell_count(p.seq);
    toy::fill(cache, p.seq, req, p.n_past, p.n_request, context_free);
    slots.commit_prompt(p.slot);
    prompt_tokens next = slots.tokens(p.slot);
    next.push_back(90000);
    toy::fill(cache, p.seq, next, next.size() - 1, next.size(), context_free);
    slots.append(p.slot, 90000);
    const auto& held = slots.tokens(p.slot);
    const double err = toy::max_error(cache, p.seq, held, held.size(), context_free);
    if (context_free)
        REQUIRE(err < 1e-5);
    else
        REQUIRE(err == 0.0);
    REQUIRE(cache.cells().seq_cell_count(p.seq) == held.size());
    slots.release(p.slot);
    return p;
}

using plain_t = kvcache::kv_cache<kvcache::f32, reuse::global<>>;
using shared_t = kvcache::shared_store<plain_t>;

/// K and V of every layer of each cell of seq, with position and pending shift, sorted.
template <class Cache>
std::vector<std::tuple<kvcache::pos_t, std::int32_t, std::vector<float>>> contents(const Cache& cache, kvcache::seq_id_t seq) {
    std::vector<std::tuple<kvcache::pos_t, std::int32_t, std::vector<float>>> out;
    const auto& s = cache.shape();
    std::vector<float> row(std::max(s.k_row_size(), s.v_row_size()));
    for (std::uint32_t c : cache.cells().used_cells()) {
        if (!cache.cells().seqs(c).test(seq)) continue;
        std::vector<float> all;
        for (std::uint32_t l = 0; l < s.n_layer; ++l) {
            cache.read_k(l, c, row.data());
            all.insert(all.end(), row.begin(), row.begin() + static_cast<long>(s.k_row_size()));
            cache.read_v(l, c, row.data());
            all.insert(all.end(), row.begin(), row.begin() + static_cast<long>(s.v_row_size()));
        }
        out.emplace_back(cache.cells().pos(c), cache.cells().shift(c), std::move(all));
    }
    std::sort(out.begin(), out.end());
    return out;
}

}  // namespace

TEST_CASE("entries: seq_generation changes with every change of a sequence's cells, and only then") {
    plain_t cache(toy::shape(256, 4));
    const auto g0 = cache.seq_generation(0);
    toy::fill(cache, 0, toy::text(8), 0, 8);
    const auto g1 = cache.seq_generation(0);
    CHECK(g1 != g0);
    CHECK(cache.seq_generation(1) == 0);  // untouched
    REQUIRE(cache.seq_cp(0, 1, -1, -1));
    CHECK(cache.seq_generation(0) == g1);  // the source keeps its cells
    const auto c1 = cache.seq_generation(1);
    CHECK(c1 != 0);
    REQUIRE(cache.seq_rm(-1, 2, 3));  // every sequence
    CHECK(cache.seq_generation(0) != g1);
    CHECK(cache.seq_generation(1) != c1);
    auto g = cache.seq_generation(0);
    REQUIRE(cache.seq_add(0, 4, 8, 2));
    CHECK(cache.seq_generation(0) != g);
    g = cache.seq_generation(0);
    REQUIRE(cache.seq_div(0, 0, 20, 2));
    CHECK(cache.seq_generation(0) != g);
    g = cache.seq_generation(0);
    const auto h = cache.seq_generation(1);
    cache.seq_keep(1);
    CHECK(cache.seq_generation(0) != g);
    g = cache.seq_generation(0);
    CHECK(cache.seq_generation(1) == h);  // seq 1 keeps every cell it had
    std::vector<kvcache::pos_t> pos{0};
    std::vector<kvcache::seq_id_t> seqs{2};
    auto placed = cache.place(pos, seqs);
    REQUIRE(placed.ok());
    const auto p2 = cache.seq_generation(2);
    CHECK(p2 != 0);
    CHECK(cache.restore() == kvcache::tx_result::restored);
    CHECK(cache.seq_generation(2) != p2);  // a restore changes the cells back: new generation
    CHECK(cache.seq_generation(1) == h);
    cache.clear();
    CHECK(cache.seq_generation(1) != h);
    CHECK_THROWS_AS(static_cast<void>(cache.seq_generation(9)), kvcache::error);
}

TEST_CASE("entries: a host seq_rm(-1, ...) under shared_store entries and a slot state is detected, never served") {
    plain_t cache(toy::shape(1024, 8));
    kvcache::slot_manager<plain_t, shared_t> slots(cache, {.n_slots = 2}, shared_t(4, 4));
    const prompt_tokens a = toy::text(60, 1000), b = toy::text(40, 5000);
    run_request(slots, cache, a, {.slot_id = 0});
    run_request(slots, cache, b, {.slot_id = 0});
    REQUIRE(slots.global_cache().size() == 2);
    REQUIRE(cache.seq_rm(-1, 0, 10));  // the host wipes positions [0, 10) of every sequence
    const auto r = run_request(slots, cache, cat(a, toy::text(5, 77)), {.slot_id = 1});
    CHECK(r.n_past == 0);
    CHECK(r.metrics.from_global == 0);
    CHECK(r.metrics.miss == miss_reason::invalidated);
    const auto m = slots.metrics();
    CHECK(m.invalidated == 2);
    CHECK(m.slot_states_invalidated == 1);
    CHECK(m.hits == 0);
    CHECK(m.misses_for(miss_reason::invalidated) == 1);
    CHECK(slots.tokens(0).empty());  // slot 0's state was dropped
}

TEST_CASE("entries: a host seq_keep wipes every slot and entry: everything is recomputed, nothing served") {
    plain_t cache(toy::shape(1024, 8));
    kvcache::slot_manager<plain_t, shared_t> slots(cache, {.n_slots = 2}, shared_t(4, 3));
    const prompt_tokens a = toy::text(50, 1000);
    run_request(slots, cache, a, {.slot_id = 0});
    toy::fill(cache, 7, toy::text(3, 9), 0, 3);
    cache.seq_keep(7);
    const auto r = run_request(slots, cache, a);
    CHECK(r.metrics.computed == a.size());
    CHECK(slots.metrics().invalidated == 1);
    CHECK(slots.metrics().slot_states_invalidated == 1);
}

TEST_CASE("entries: a slot state whose cells the host removed is dropped (reuse::lcp, no global cache)") {
    using cache_t = kvcache::kv_cache<reuse::lcp>;
    cache_t cache(toy::shape(512, 2));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
    const prompt_tokens a = toy::text(40);
    run_request(slots, cache, a);
    REQUIRE(cache.seq_rm(0, 5, 10));  // a hole in the idle slot's sequence
    const auto r = run_request(slots, cache, a);
    CHECK(r.n_past == 0);
    CHECK(r.metrics.miss == miss_reason::invalidated);
    CHECK(slots.metrics().slot_states_invalidated == 1);
    // untouched, the next repeat is reused again
    CHECK(run_request(slots, cache, a).metrics.from_slot == a.size() - 1);
}

TEST_CASE("entries: release of a slot whose sequence the host changed while busy does not save it") {
    plain_t cache(toy::shape(512, 4));
    kvcache::slot_manager<plain_t> slots(cache, {.n_slots = 1});
    const prompt_tokens a = toy::text(30);
    auto p = slots.prepare(a).value();
    toy::fill(cache, p.seq, a, 0, a.size());
    slots.commit_prompt(p.slot);
    REQUIRE(cache.seq_rm(p.seq, 3, 4));  // the host breaks the sequence after commit_prompt
    slots.release(p.slot);
    CHECK(slots.global_cache().size() == 0);
    CHECK(slots.tokens(0).empty());
    CHECK(slots.metrics().slot_states_invalidated == 1);
}

TEST_CASE("prompt_cache::save checks the key against the sequence it saves") {
    plain_t cache(toy::shape(256, 4));
    kvcache::prompt_cache<plain_t> pc(kvcache::prompt_cache_limits{0, 0});
    toy::fill(cache, 0, toy::text(5), 0, 5);
    CHECK_THROWS_WITH_AS(pc.save(cache, 0, toy::text(12)),
                         doctest::Contains("the key has 12 tokens but sequence 0 ends at position 4"), kvcache::error);
    CHECK_THROWS_WITH_AS(pc.save(cache, 1, toy::text(3)), doctest::Contains("sequence 1 is empty"), kvcache::error);
    CHECK(pc.size() == 0);
    CHECK(pc.save(cache, 0, toy::text(5)).has_value());
    CHECK(pc.size() == 1);
}

TEST_CASE("copy_store restores a sequence holding a position twice (after seq_div)") {
    plain_t cache(toy::shape(256, 4));
    toy::fill(cache, 0, toy::text(8), 0, 8);
    REQUIRE(cache.seq_div(0, 0, 8, 2));  // positions 0, 0, 1, 1, 2, 2, 3, 3
    REQUIRE(cache.cells().seq_positions(0).at(1) == 2);
    const auto before = contents(cache, 0);
    kvcache::copy_store<plain_t> st;
    auto h = st.save(cache, 0).value();
    REQUIRE(cache.seq_rm(0, -1, -1));
    REQUIRE(st.load(cache, 1, h));
    CHECK(contents(cache, 1) == before);
    CHECK(cache.seq_pos_max(1) == 3);
    CHECK(cache.cells().seq_cell_count(1) == 8);
    CHECK(!cache.in_transaction());
}

TEST_CASE("prompt_cache::load with copy_store never commits the host's staged placements") {
    plain_t cache(toy::shape(256, 8));
    kvcache::prompt_cache<plain_t> pc(kvcache::prompt_cache_limits{0, 0});
    const prompt_tokens p = toy::text(10);
    toy::fill(cache, 0, p, 0, p.size());
    const auto id = pc.save(cache, 0, p);
    REQUIRE(id);
    std::vector<kvcache::pos_t> pos{0};
    std::vector<kvcache::seq_id_t> seqs{5};
    REQUIRE(cache.place(pos, seqs).ok());  // the host's own micro-batch, staged
    CHECK_THROWS_WITH_AS(static_cast<void>(pc.load(cache, 3, *id)), doctest::Contains("placements are staged"),
                         kvcache::error);
    CHECK_THROWS_WITH_AS(pc.save(cache, 0, p), doctest::Contains("placements are staged"), kvcache::error);
    REQUIRE(cache.in_transaction());
    CHECK(cache.restore() == kvcache::tx_result::restored);
    CHECK(cache.seq_pos_max(5) == -1);
    CHECK(cache.seq_pos_max(3) == -1);
    CHECK(pc.size() == 1);
    REQUIRE(pc.load(cache, 3, *id).ok());  // afterwards it loads
    CHECK(toy::max_error(cache, 3, p, p.size()) == 0.0);
}

TEST_CASE("prompt_cache::save never returns the id of an entry its own limits evicted (LFU)") {
    plain_t cache(toy::shape(512, 4));
    kvcache::prompt_cache<plain_t, kvcache::copy_store<plain_t>, reuse::evict_lfu> pc(kvcache::prompt_cache_limits{0, 100});
    const prompt_tokens a = toy::text(60, 100), b = toy::text(60, 5000);
    toy::fill(cache, 0, a, 0, a.size());
    REQUIRE(pc.save(cache, 0, a, {.hits = 5}));
    toy::fill(cache, 1, b, 0, b.size());
    const auto id = pc.save(cache, 1, b);  // 0 hits: the new entry is the one LFU evicts
    CHECK(pc.size() == 1);
    CHECK(!id.has_value());
    if (id) CHECK(pc.tokens_of(*id) != nullptr);
    CHECK(pc.metrics().evictions == 1);
}

TEST_CASE("entries: a failed global load keeps the slot's own state, reuses it and counts no hit") {
    plain_t cache(toy::shape(512, 8));
    kvcache::slot_manager<plain_t> slots(cache, {.n_slots = 2, .cache_limits = {0, 0}});
    const prompt_tokens common = toy::text(20, 1000);
    const prompt_tokens a = cat(common, toy::text(280, 3000));  // the entry: 300 tokens (+1 generated)
    const prompt_tokens c = cat(common, toy::text(10, 8000));   // slot 1's state shares 20 tokens
    run_request(slots, cache, a, {.slot_id = 0});
    run_request(slots, cache, c, {.slot_id = 1});
    REQUIRE(slots.global_cache().size() == 2);
    slots.clear_slot(0);
    // the host fills the cache so that the entry (301 cells) cannot be loaded
    const std::uint32_t free_now = cache.capacity() - cache.used();
    const std::uint32_t filler = free_now - 200;
    toy::fill(cache, 7, toy::text(filler, 20000), 0, filler);
    const prompt_tokens req = cat(a, toy::text(4, 77));
    auto p = slots.prepare(req, {.slot_id = 1}).value();
    CHECK(p.metrics.from_global == 0);
    CHECK(p.metrics.from_slot == 20);  // the slot's own state, kept
    CHECK(p.metrics.miss == miss_reason::load_failed);
    CHECK(toy::max_error(cache, p.seq, req, 20) == 0.0);
    const auto m = slots.metrics();
    CHECK(m.hits == 0);
    CHECK(m.load_failures == 1);
    CHECK(m.misses_for(miss_reason::load_failed) == 1);
    CHECK(slots.global_cache().size() == 2);  // the entry is kept
    REQUIRE(cache.seq_rm(7, -1, -1));
    toy::fill(cache, p.seq, req, p.n_past, p.n_request);
    slots.commit_prompt(p.slot);
    CHECK(toy::max_error(cache, p.seq, req, req.size()) == 0.0);
    slots.release(p.slot);
}

TEST_CASE("entries: paged + shared_store never wedges: eviction counts blocks") {
    using cache_t = kvcache::kv_cache<kvcache::paged<32>, reuse::global<>>;
    using store_t = kvcache::shared_store<cache_t>;
    cache_t cache(toy::shape(512, 16));  // 16 blocks of 32 cells
    kvcache::slot_manager<cache_t, store_t> slots(cache, {.n_slots = 1, .cache_limits = {0, 0}}, store_t(4, 12));
    std::mt19937 rng(25);
    for (int k = 0; k < 30; ++k) {  // distinct prompts: every entry keeps its blocks
        const auto n = 33 + rng() % 40;
        const auto r = run_request(slots, cache, toy::text(n, static_cast<token_t>(1000 + 100 * k)), {.slot_id = 0});
        CHECK(r.metrics.computed == n);
    }
    CHECK(slots.metrics().evictions > 0);
    CHECK(slots.global_cache().size() >= 1);
}

TEST_CASE("slots on a ring layout with n_swa = 0 take the ring's window (slot item of issue 25, 10)") {
    constexpr std::uint32_t w = 8;
    using ring_t = kvcache::kv_cache<kvcache::ring<w>, reuse::lcp>;
    ring_t cache(toy::shape(kvcache::ring<w>::cells_for(2, 64), 2));
    CHECK_THROWS_WITH_AS(kvcache::slot_manager<ring_t>(cache, {.n_slots = 1, .n_swa = 5}),
                         doctest::Contains("the ring layout's window is 8"), kvcache::error);
    kvcache::slot_manager<ring_t> slots(cache, {.n_slots = 1});  // n_swa = 0: the ring's window
    const prompt_tokens p = toy::text(40);
    auto r = slots.prepare(p).value();
    toy::fill(cache, r.seq, p, 0, 40);
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    // An exact repeat re-enters at 39: the query there sees (31, 39], which the ring holds.
    r = slots.prepare(p).value();
    CHECK(r.n_past == 39);
    CHECK(r.metrics.from_slot == 39);
    CHECK(toy::max_error(cache, r.seq, p, 39, false, 39 - w + 1) == 0.0);
    toy::fill(cache, r.seq, p, 39, 40);
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    // One position earlier is too far: the query at 38 sees (30, 38], position 31 is gone.
    const prompt_tokens p38 = cat(toy::text(38), toy::text(2, 8000));
    r = slots.prepare(p38).value();
    CHECK(r.n_past == 0);
    CHECK(r.metrics.miss == miss_reason::swa);
    toy::fill(cache, r.seq, p38, 0, p38.size());
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    const prompt_tokens q = cat(toy::text(30), toy::text(10, 7000));
    r = slots.prepare(q).value();  // the window forgot position 22 and there is no checkpoint
    CHECK(r.n_past == 0);
    CHECK(r.metrics.miss == miss_reason::swa);
    toy::fill(cache, r.seq, q, 0, q.size());
    slots.commit_prompt(r.slot);
    slots.release(r.slot);
    CHECK(slots.metrics().misses_for(miss_reason::swa) == 2);  // p38 and q
}

TEST_CASE("metrics: miss reasons salt, evicted, media") {
    SUBCASE("salt") {
        using cache_t = kvcache::kv_cache<reuse::lcp>;
        cache_t cache(toy::shape(512, 2));
        kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 2});
        const prompt_tokens a = toy::text(40);
        run_request(slots, cache, a, {.salt = 1});
        const auto r = run_request(slots, cache, a, {.salt = 2});
        CHECK(r.n_past == 0);
        CHECK(r.metrics.miss == miss_reason::salt);
        CHECK(slots.metrics().misses_for(miss_reason::salt) == 1);
    }
    SUBCASE("evicted") {
        plain_t cache(toy::shape(512, 2));
        kvcache::slot_manager<plain_t> slots(cache, {.n_slots = 1, .cache_limits = {0, 50}});
        const prompt_tokens a = toy::text(40, 1000), b = toy::text(40, 5000);
        run_request(slots, cache, a);
        run_request(slots, cache, b);  // a's entry is evicted by the token limit
        CHECK(slots.metrics().evictions == 1);
        const auto r = run_request(slots, cache, a);
        CHECK(r.n_past == 0);
        CHECK(r.metrics.miss == miss_reason::evicted);
        CHECK(slots.metrics().misses_for(miss_reason::evicted) == 1);
    }
    SUBCASE("media") {
        using cache_t = kvcache::kv_cache<reuse::lcp>;
        cache_t cache(toy::shape(512, 2));
        kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
        prompt_tokens a = toy::text(20), b = toy::text(20);
        a.push_media(1, 8);
        b.push_media(2, 8);  // another image at the same place
        a.append(toy::text(5, 3000).tokens());
        b.append(toy::text(5, 3000).tokens());
        run_request(slots, cache, a);
        const auto r = run_request(slots, cache, b);
        CHECK(r.n_past == 20);
        CHECK(r.metrics.miss == miss_reason::media);
    }
    SUBCASE("a full hit or a fresh prompt is no miss") {
        using cache_t = kvcache::kv_cache<reuse::lcp>;
        cache_t cache(toy::shape(512, 2));
        kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 1});
        CHECK(run_request(slots, cache, toy::text(30)).metrics.miss == miss_reason::none);
        CHECK(run_request(slots, cache, toy::text(30)).metrics.miss == miss_reason::none);
        CHECK(run_request(slots, cache, toy::text(30, 7000)).metrics.miss == miss_reason::none);
        const auto m = slots.metrics();
        for (std::size_t i = 0; i < kvcache::n_miss_reasons; ++i) CHECK(m.misses[i] == 0);
    }
}

TEST_CASE("metrics: hit_tokens equals the cells not recomputed over a random request stream") {
    using cache_t = kvcache::kv_cache<kvcache::f32, reuse::global<reuse::chunk_shift<8>>>;
    cache_t cache(toy::shape(8192, 4));
    kvcache::slot_manager<cache_t> slots(cache, {.n_slots = 2, .cache_limits = {0, 3000}});
    std::mt19937 rng(9);
    std::vector<prompt_tokens> prefixes;
    for (int i = 0; i < 6; ++i) prefixes.push_back(toy::text(40 + 8 * static_cast<std::size_t>(i), static_cast<token_t>(1000 * (i + 1))));
    std::uint64_t reused = 0, queried = 0;
    const int n = 300;
    for (int k = 0; k < n; ++k) {
        prompt_tokens req = prefixes[rng() % prefixes.size()];
        if (rng() % 3 == 0) {  // an edit near the front: chunk shifting can move the rest
            prompt_tokens edited = toy::text(3, static_cast<token_t>(60000 + rng() % 5));
            edited.append(req.tokens());
            req = edited;
        }
        req.append(toy::text(1 + rng() % 12, static_cast<token_t>(30000 + rng() % 4)).tokens());
        queried += req.size();
        run_request(slots, cache, req, {}, true, &reused);
    }
    const auto m = slots.metrics();
    CHECK(m.requests == static_cast<std::uint64_t>(n));
    CHECK(m.query_tokens == queried);
    CHECK(m.hit_tokens == reused);
    CHECK(m.hit_tokens == m.hit_tokens_slot + m.hit_tokens_global + m.hit_tokens_shifted);
    CHECK(m.hit_tokens_slot > 0);
    CHECK(m.hit_tokens_global > 0);
    CHECK(m.hit_tokens_shifted > 0);
    CHECK(m.hits > 0);
    CHECK(m.token_hit_rate() == doctest::Approx(double(reused) / double(queried)));
    MESSAGE("token hit rate " << m.token_hit_rate() << " (slot " << m.hit_tokens_slot << ", global "
                              << m.hit_tokens_global << ", shifted " << m.hit_tokens_shifted << ")");
}

TEST_CASE("metrics: Prometheus text exposition format") {
    kvcache::prefix_cache_metrics m;
    m.requests = 3;
    m.query_tokens = 100;
    m.hit_tokens_slot = 7;
    m.hit_tokens_global = 11;
    m.hit_tokens_shifted = 13;
    m.hit_tokens = 31;
    m.misses[static_cast<std::size_t>(miss_reason::evicted)] = 2;
    m.evictions = 4;
    m.slot_states_evicted = 5;
    m.room_refused = 6;
    m.bytes = 123456;
    const std::vector<kvcache::metric_label> labels{{"model", "m\"1\\x\ny"}};
    const std::string text = kvcache::to_prometheus(m, "kvcache", labels);
    const std::string lab = "model=\"m\\\"1\\\\x\\ny\"";
    CHECK(text.find("kvcache_prefix_cache_queries_total{" + lab + "} 100\n") != std::string::npos);
    CHECK(text.find("kvcache_prefix_cache_hits_total{" + lab + ",source=\"slot\"} 7\n") != std::string::npos);
    CHECK(text.find("kvcache_prefix_cache_hits_total{" + lab + ",source=\"global\"} 11\n") != std::string::npos);
    CHECK(text.find("kvcache_prefix_cache_hits_total{" + lab + ",source=\"shifted\"} 13\n") != std::string::npos);
    CHECK(text.find("kvcache_prefix_cache_misses_total{" + lab + ",reason=\"evicted\"} 2\n") != std::string::npos);
    CHECK(text.find("kvcache_prompt_cache_bytes{" + lab + "} 123456\n") != std::string::npos);
    CHECK(text.find("kvcache_slot_states_evicted_total{" + lab + "} 5\n") != std::string::npos);
    CHECK(text.find("kvcache_prefix_cache_room_refused_total{" + lab + "} 6\n") != std::string::npos);
    CHECK(text.find("# TYPE kvcache_prompt_cache_bytes gauge\n") != std::string::npos);
    // the grammar: HELP then TYPE once per metric, samples only of a declared metric
    std::istringstream in(text);
    std::string line, declared, helped;
    std::set<std::string> types;
    int samples = 0;
    while (std::getline(in, line)) {
        REQUIRE(!line.empty());
        if (line.rfind("# HELP ", 0) == 0) {
            helped = line.substr(7, line.find(' ', 7) - 7);
            continue;
        }
        if (line.rfind("# TYPE ", 0) == 0) {
            const std::string name = line.substr(7, line.find(' ', 7) - 7);
            const std::string type = line.substr(line.find(' ', 7) + 1);
            CHECK(name == helped);
            CHECK(types.insert(name).second);
            CHECK((type == "counter" || type == "gauge"));
            if (type == "counter") CHECK(name.size() > 6);
            if (type == "counter") CHECK(name.substr(name.size() - 6) == "_total");
            declared = name;
            continue;
        }
        REQUIRE(line[0] != '#');
        const std::size_t name_end = line.find_first_of("{ ");
        CHECK(line.substr(0, name_end) == declared);
        const std::string value = line.substr(line.rfind(' ') + 1);
        CHECK(value.find_first_not_of("0123456789") == std::string::npos);
        if (line[name_end] == '{') CHECK(line[line.rfind(' ') - 1] == '}');
        ++samples;
    }
    CHECK(samples >= 20);
    // without labels: bare names
    const std::string bare = kvcache::to_prometheus(m);
    CHECK(bare.find("\nkvcache_requests_total 3\n") != std::string::npos);
    CHECK(bare.find("kvcache_prefix_cache_hits_total{source=\"slot\"} 7\n") != std::string::npos);
    CHECK_THROWS_WITH_AS(kvcache::to_prometheus(m, "1x"), doctest::Contains("prefix"), kvcache::error);
    const std::vector<kvcache::metric_label> bad{{"a-b", "v"}};
    CHECK_THROWS_WITH_AS(kvcache::to_prometheus(m, "kv", bad), doctest::Contains("a-b"), kvcache::error);
    const std::vector<kvcache::metric_label> reserved{{"__name__", "v"}};
    CHECK_THROWS_AS(kvcache::to_prometheus(m, "kv", reserved), kvcache::error);
}
