// slot_manager with storage tiers attached (slot_manager::attach_tiers, issue 30): release
// publishes, prepare fetches a longer prefix than the slot or the global entry gave. A fresh
// cache and manager (another process) hits the disk tier; the K/V it loads equals a cold
// computation bit for bit; metrics and one Prometheus text with the prefix-cache and tier
// counters; the longer of slot and tier wins; salts; scratch sequence checks; a corrupt
// blob and a tier that throws; reuse::lcp (no global cache) on the paged layout.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tier_test_util.hpp"

using namespace kvcache;

namespace {
using tslot_global = kv_cache<f16, reuse::global<>>;            // contiguous, global prompt cache
using tslot_paged = kv_cache<f16, paged<32>, reuse::lcp>;      // paged, no global cache
using tslot_disk_chain = tier::tier_cache<tslot_global, tier::disk_tier>;
using tslot_mem_chain = tier::tier_cache<tslot_paged, tier::memory_tier>;

std::uint64_t tslot_mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/// The host's computation of positions [from, to) of p into seq: K/V of position i are a
/// function of the tokens [0, i] (as a model's are), whatever `from` is.
template <class Cache>
void tslot_fill(Cache& c, seq_id_t s, const prompt_tokens& p, std::size_t from, std::size_t to) {
    if (from >= to) return;
    std::vector<pos_t> pos;
    for (std::size_t i = from; i < to; ++i) pos.push_back(static_cast<pos_t>(i));
    std::vector<seq_id_t> seq(pos.size(), s);
    auto r = c.place(pos, seq);
    REQUIRE(r);
    const auto& sh = c.shape();
    const std::size_t kr = sh.k_row_size(), vr = sh.v_row_size();
    std::vector<std::uint64_t> h(to);
    std::uint64_t acc = 0;
    for (std::size_t i = 0; i < to; ++i) h[i] = acc = tslot_mix(acc ^ static_cast<std::uint64_t>(p[i]));
    auto val = [](std::uint64_t x) { return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-53 * 4.0 - 2.0); };
    std::vector<float> k(pos.size() * kr), v(pos.size() * vr);
    for (std::uint32_t l = 0; l < sh.n_layer; ++l) {
        for (std::size_t i = 0; i < pos.size(); ++i) {
            for (std::size_t j = 0; j < kr; ++j) k[i * kr + j] = val(tslot_mix(h[from + i] ^ (l * 1000003ull + j)));
            for (std::size_t j = 0; j < vr; ++j) v[i * vr + j] = val(tslot_mix(~h[from + i] ^ (l * 1000003ull + j)));
        }
        c.write_k(l, r.value().cells, k.data());
        c.write_v(l, r.value().cells, v.data());
    }
    static_cast<void>(c.commit());
}

/// Sequence s of a fresh cache after a cold computation of p.
template <class Cache>
std::vector<std::byte> tslot_cold(seq_id_t s, const prompt_tokens& p) {
    Cache ref(tiertest::tier_shape());
    tslot_fill(ref, s, p, 0, p.size());
    return io::save_seq(ref, s);
}

/// Serves p on the manager as a host does: prepare, compute the rest, commit, release.
template <class Cache>
prepared_request tslot_serve(slot_manager<Cache>& sm, Cache& c, const prompt_tokens& p, const request_options& ro = {}) {
    auto r = sm.prepare(p, ro);
    REQUIRE(r);
    prepared_request out = r.value();
    tslot_fill(c, out.seq, p, out.n_past, p.size());
    sm.commit_prompt(out.slot);
    CHECK(io::save_seq(c, out.seq) == tslot_cold<Cache>(out.seq, p));
    sm.release(out.slot);
    return out;
}

prompt_tokens tslot_first(const prompt_tokens& p, std::size_t n) {
    prompt_tokens q = p;
    q.keep_first(n);
    return q;
}

}  // namespace

// (Registered under the tier_cache CTest suite: tests/CMakeLists.txt lists the tier suites.)
TEST_SUITE("tier_cache") {
TEST_CASE("slots + tiers: published on release, a fresh process hits the disk tier; longer of slot and tier wins") {
    const std::string dir = tiertest::tier_scratch_dir("slots_hook");
    const prompt_tokens req = tiertest::tier_prompt(80, 44);
    {  // "Process A": a cold request, published by release().
        tslot_global a(tiertest::tier_shape());
        slot_manager<tslot_global> sa(a, {.n_slots = 2});
        tslot_disk_chain ta({.block_tokens = 32}, tier::disk_tier(dir, {.sync = false}));
        sa.attach_tiers(ta, {.scratch_seq = 3});
        CHECK(sa.has_tiers());
        const auto p = tslot_serve(sa, a, req);
        CHECK(p.n_past == 0);
        CHECK(p.metrics.from_tier == 0);
        CHECK(p.metrics.tier == -1);
        const auto m = ta.metrics();
        CHECK(m.fetches == 1);
        CHECK(m.publishes == 1);
        CHECK(m.published == 1);
    }
    // "Process B": a fresh cache, manager and chain on the same directory.
    tslot_global b(tiertest::tier_shape());
    slot_manager<tslot_global> sb(b, {.n_slots = 2});
    tslot_disk_chain tb({.block_tokens = 32}, tier::disk_tier(dir, {.sync = false}));
    sb.attach_tiers(tb, {.scratch_seq = 3});
    // Its first 40 tokens: the blob is keyed at 64 only, a miss; computed, kept by the slot.
    const auto p40 = tslot_serve(sb, b, tslot_first(req, 40));
    CHECK(p40.n_past == 0);
    // The whole request: the slot (and the global entry) give 40, the disk tier 79: the tier wins.
    auto r = sb.prepare(req);
    REQUIRE(r);
    const auto p = r.value();
    CHECK(p.slot == p40.slot);
    CHECK(p.n_past == 79);  // the last position is computed (its logits)
    CHECK(p.metrics.from_slot + p.metrics.from_global == 40);
    CHECK(p.metrics.from_tier == 39);
    CHECK(p.metrics.tier == 0);
    CHECK(p.metrics.hit_tokens() == 79);
    CHECK(p.metrics.computed == 1);
    CHECK(p.plan.n_past == 79);
    CHECK(b.seq_pos_max(3) < 0);  // the scratch sequence is empty again
    CHECK(sb.tokens(p.slot).size() == 79);
    tslot_fill(b, p.seq, req, p.n_past, req.size());
    sb.commit_prompt(p.slot);
    CHECK(io::save_seq(b, p.seq) == tslot_cold<tslot_global>(p.seq, req));
    sb.release(p.slot);
    CHECK(tb.metrics().already_held == 1);  // the blob of req is on disk already
    // The request extended: the slot holds all 80, the tier offers 80 too: not taken.
    prompt_tokens longer = req;
    for (token_t t = 0; t < 40; ++t) longer.push_back(900 + t);
    const auto q = tslot_serve(sb, b, longer);
    CHECK(q.n_past == 80);
    CHECK(q.metrics.from_tier == 0);
    CHECK(q.metrics.tier == -1);
    CHECK(q.metrics.from_slot + q.metrics.from_global == 80);
    // Another tenant: the tier's keys are salted, a miss (and the slot is not reused).
    const auto s5 = tslot_serve(sb, b, req, {.salt = 5});
    CHECK(s5.n_past == 0);
    CHECK(s5.metrics.from_tier == 0);
    // Counters: one Prometheus text with the prefix-cache and the tier counters.
    const auto m = sb.metrics();
    CHECK(m.hit_tokens_tier == 39);
    CHECK(m.hit_tokens == m.hit_tokens_slot + m.hit_tokens_global + m.hit_tokens_shifted + m.hit_tokens_tier);
    CHECK(m.tier_fetch_errors == 0);
    CHECK(m.tier_publish_errors == 0);
    const auto tm = tb.metrics();
    CHECK(tm.fetch_hits == 2);  // req (taken) and longer (not longer than the slot)
    const metric_label lab[] = {{"model", "toy"}};
    const std::string text = sb.to_prometheus_all("svc", lab);
    CHECK(text.find("svc_prefix_cache_hits_total{model=\"toy\",source=\"tier\"} 39\n") != std::string::npos);
    CHECK(text.find("svc_tier_hits_total{model=\"toy\",tier=\"disk\"} " + std::to_string(tm.tiers[0].hits) + "\n") !=
          std::string::npos);
    CHECK(text.find("svc_prompt_cache_inserts_total{model=\"toy\"}") != std::string::npos);
    CHECK(text.find("svc_prefix_cache_tier_errors_total{model=\"toy\",op=\"fetch\"} 0\n") != std::string::npos);
    std::set<std::string> names;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
        if (line.starts_with("# TYPE ")) CHECK_MESSAGE(names.insert(line.substr(7, line.find(' ', 7) - 7)).second, line);
    CHECK(names.size() > 20);
    const metric_label quote[] = {{"model", "a\"b"}};  // the tier text does not escape
    CHECK_THROWS_AS(static_cast<void>(sb.to_prometheus_all("svc", quote)), kvcache::error);
    // Without tiers the text is the prefix-cache one.
    sb.detach_tiers();
    CHECK_FALSE(sb.has_tiers());
    CHECK(sb.to_prometheus_all() == to_prometheus(sb.metrics()));
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("slots + tiers: scratch sequence checks; a corrupt blob is a counted refusal and the request is computed") {
    const std::string dir = tiertest::tier_scratch_dir("slots_corrupt");
    const prompt_tokens req = tiertest::tier_prompt(70, 12);
    tslot_global c(tiertest::tier_shape());  // n_seq_max = 4
    slot_manager<tslot_global> sm(c, {.n_slots = 2, .first_seq = 1});
    tslot_disk_chain tc({.block_tokens = 32}, tier::disk_tier(dir, {.sync = false}));
    CHECK_THROWS_AS(sm.attach_tiers(tc, {.scratch_seq = -1}), kvcache::error);  // not given
    CHECK_THROWS_AS(sm.attach_tiers(tc, {.scratch_seq = 4}), kvcache::error);   // >= n_seq_max
    CHECK_THROWS_AS(sm.attach_tiers(tc, {.scratch_seq = 2}), kvcache::error);   // slot 1's sequence
    tslot_fill(c, 3, req, 0, 10);
    CHECK_THROWS_AS(sm.attach_tiers(tc, {.scratch_seq = 3}), kvcache::error);   // holds positions
    CHECK_FALSE(sm.has_tiers());
    REQUIRE(c.seq_rm(3, -1, -1));
    sm.attach_tiers(tc, {.scratch_seq = 3});
    const auto p = tslot_serve(sm, c, req);
    REQUIRE(tc.metrics().published == 1);
    // The host used the scratch sequence: prepare refuses before anything changes.
    tslot_fill(c, 3, req, 0, 5);
    const auto before = io::save_state(c);
    CHECK_THROWS_AS(static_cast<void>(sm.prepare(req)), kvcache::error);
    CHECK(io::save_state(c) == before);
    CHECK_FALSE(sm.busy(0));
    REQUIRE(c.seq_rm(3, -1, -1));
    // Flip a byte of the blob on disk; a request on the other slot (its own state empty,
    // the global entry dropped) meets the corrupt blob: refused, counted, erased; computed.
    sm.global_cache().clear(c);
    const auto k = tier::block_keys(req, 32, tier::memory_fingerprint(c), 0).back().k;
    {
        std::fstream f(tc.get<0>().path_of(k), std::ios::in | std::ios::out | std::ios::binary);
        REQUIRE(f);
        f.seekp(-100, std::ios::end);
        f.put('\x5a');
    }
    const auto q = tslot_serve(sm, c, req, {.slot_id = 1 - p.slot});
    CHECK(q.n_past == 0);
    CHECK(q.metrics.from_tier == 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::corrupt) == 1);
    CHECK(c.seq_pos_max(3) < 0);
    // release() published it again: the next fresh slot is served from the tier.
    CHECK(tc.metrics().published == 2);
    sm.clear_slot(0);
    sm.clear_slot(1);
    sm.global_cache().clear(c);
    const auto t = tslot_serve(sm, c, req);
    CHECK(t.metrics.from_tier == 69);
    // fetch_on_prepare / publish_on_release off: the tiers are not asked.
    sm.attach_tiers(tc, {.scratch_seq = 3, .publish_on_release = false, .fetch_on_prepare = false});
    sm.clear_slot(0);
    sm.clear_slot(1);
    sm.global_cache().clear(c);
    const auto fetches = tc.metrics().fetches, publishes = tc.metrics().publishes;
    CHECK(tslot_serve(sm, c, req).n_past == 0);
    CHECK(tc.metrics().fetches == fetches);
    CHECK(tc.metrics().publishes == publishes);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("slots + tiers: reuse::lcp without a global cache on the paged layout; one chain shared by two caches") {
    const prompt_tokens req = tiertest::tier_prompt(90, 7);
    tslot_mem_chain tc({.block_tokens = 16}, tier::memory_tier());
    tslot_paged a(tiertest::tier_shape());
    slot_manager<tslot_paged> sa(a, {.n_slots = 2});
    sa.attach_tiers(tc, {.scratch_seq = 2});
    const auto p = tslot_serve(sa, a, req);
    CHECK(p.n_past == 0);
    // The other slot of the same manager: the tiers are the only cache shared by the slots.
    const auto q = tslot_serve(sa, a, req, {.slot_id = 1 - p.slot});
    CHECK(q.n_past == 89);
    CHECK(q.metrics.from_tier == 89);
    CHECK(q.metrics.from_slot == 0);
    CHECK(q.metrics.tier == 0);
    // Another cache (another engine instance in this process) with the same chain.
    tslot_paged b(tiertest::tier_shape());
    slot_manager<tslot_paged> sb(b, {.n_slots = 2});
    sb.attach_tiers(tc, {.scratch_seq = 3});
    const auto r = tslot_serve(sb, b, req);  // checks the K/V against a cold computation
    CHECK(r.n_past == 89);
    CHECK(sb.metrics().hit_tokens_tier == 89);
    CHECK(sb.metrics().hit_tokens == 89);
    // A request diverging at 50: the tier's 90-token blob is keyed at 80: a miss; the slot keeps 50.
    prompt_tokens d = tslot_first(req, 50);
    for (token_t t = 0; t < 30; ++t) d.push_back(500 + t);
    const auto e = tslot_serve(sb, b, d, {.slot_id = r.slot});
    CHECK(e.n_past == 50);
    CHECK(e.metrics.from_slot == 50);
    CHECK(e.metrics.from_tier == 0);
}

TEST_CASE("slots + tiers: a tier that throws: fetch leaves the plan's prefix, release completes; both counted") {
    using throwing_chain = tier::tier_cache<tslot_paged, tiertest::throwing_tier>;
    bool fail = false;
    throwing_chain tc({.block_tokens = 16}, tiertest::throwing_tier{&fail, tier::memory_tier()});
    const prompt_tokens req = tiertest::tier_prompt(64, 3);
    tslot_paged c(tiertest::tier_shape());
    slot_manager<tslot_paged> sm(c, {.n_slots = 2});
    sm.attach_tiers(tc, {.scratch_seq = 3});
    const auto p = tslot_serve(sm, c, tslot_first(req, 40));
    fail = true;
    // The slot gives 40, the tier throws: 40 kept, counted.
    const auto q = tslot_serve(sm, c, req);
    CHECK(q.slot == p.slot);
    CHECK(q.n_past == 40);
    CHECK(q.metrics.from_slot == 40);
    CHECK(q.metrics.from_tier == 0);
    CHECK(c.seq_pos_max(3) < 0);
    const auto m = sm.metrics();
    CHECK(m.tier_fetch_errors == 1);
    CHECK(m.tier_publish_errors == 1);  // tslot_serve released it: the publish threw
    CHECK_FALSE(sm.busy(q.slot));
    CHECK(sm.tokens(q.slot).size() == 64);
    fail = false;
    // The slot still serves its state.
    const auto r = tslot_serve(sm, c, req);
    CHECK(r.n_past == 63);
    CHECK(r.metrics.from_slot == 63);
    CHECK(sm.to_prometheus_all().find("kvcache_prefix_cache_tier_errors_total{op=\"publish\"} 1\n") != std::string::npos);
}
}
