// tier_cache: the memory -> disk chain as policies (write-through, write-back, admission on
// the second sighting), longest-prefix probing, promotion on a lower-tier hit, a refused
// upper-tier blob falling through to a good lower one, metrics and their Prometheus text.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>
#include <kvcache/tier/disk_tier.hpp>

#include <string>
#include <vector>

#include "tier_test_util.hpp"

using namespace kvcache;

namespace {
using chain2 = tier::tier_cache<tiertest::tier_kv, tier::memory_tier, tier::disk_tier>;

/// Sequence dst's bytes after loading the first n positions of the (seed, 96) fill.
std::vector<std::byte> chain_expected(seq_id_t dst, std::uint32_t n, std::uint32_t seed) {
    tiertest::tier_kv ref(tiertest::tier_shape());
    tiertest::tier_fill(ref, dst, 96, seed);
    REQUIRE(ref.seq_rm(dst, static_cast<pos_t>(n), -1));
    return tiertest::tier_seq_bytes(ref, dst);
}
}  // namespace

TEST_SUITE("tier_cache") {
TEST_CASE("tier_cache: write-through, restart of the upper tier, promotion, longest prefix first") {
    const std::string dir = tiertest::tier_scratch_dir("chain");
    const prompt_tokens p = tiertest::tier_prompt(96, 21);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 96, 21);
    {
        chain2 tc({.block_tokens = 32}, tier::memory_tier(), tier::disk_tier(dir, {.sync = false}));
        prompt_tokens half = p;
        half.keep_first(40);
        tiertest::tier_kv h(tiertest::tier_shape());
        tiertest::tier_fill(h, 0, 96, 21);
        REQUIRE(h.seq_rm(0, 40, -1));
        CHECK(tc.publish(h, 0, half).key_tokens == 32);
        CHECK(tc.publish(c, 0, p).key_tokens == 96);
        CHECK(tc.publish(c, 0, p).stored == false);  // held already
        const auto m = tc.metrics();
        CHECK(m.published == 2);
        CHECK(m.already_held == 1);
        CHECK(m.tiers[0].puts == 2);
        CHECK(m.tiers[1].puts == 2);
        // Longest first: the 96-token entry, from memory.
        const auto f = tc.fetch(c, 1, p);
        CHECK(f.n_tokens == 96);
        CHECK(f.tier == 0);
        CHECK(tiertest::tier_seq_bytes(c, 1) == chain_expected(1, 96, 21));
        REQUIRE(c.seq_rm(1, -1, -1));
        // A request diverging at 50: the 96-token entry's key at 32 is not held (entries
        // are keyed at their longest boundary), the 40-token entry's is: 40 positions.
        prompt_tokens q = p;
        q.keep_first(50);
        q.push_back(3);
        const auto g = tc.fetch(c, 1, q);
        CHECK(g.n_tokens == 40);
        CHECK(tiertest::tier_seq_bytes(c, 1) == chain_expected(1, 40, 21));
        REQUIRE(c.seq_rm(1, -1, -1));
        // max_tokens caps what is loaded (the request's last token must be computed).
        CHECK(tc.fetch(c, 1, p, 0, 95).n_tokens == 95);  // the 96-position entry, cut at 95
        CHECK(tiertest::tier_seq_bytes(c, 1) == chain_expected(1, 95, 21));
        REQUIRE(c.seq_rm(1, -1, -1));
    }
    // A new process: empty memory tier, the disk still holds both entries.
    chain2 tc({.block_tokens = 32}, tier::memory_tier(), tier::disk_tier(dir, {.sync = false}));
    auto f = tc.fetch(c, 2, p);
    CHECK(f.n_tokens == 96);
    CHECK(f.tier == 1);
    CHECK(tc.metrics().tiers[0].promotions == 1);
    REQUIRE(c.seq_rm(2, -1, -1));
    f = tc.fetch(c, 2, p);
    CHECK(f.tier == 0);  // promoted
    CHECK(tiertest::tier_seq_bytes(c, 2) == chain_expected(2, 96, 21));
    REQUIRE(c.seq_rm(2, -1, -1));
    // A corrupt copy in memory falls through to the good copy on disk (and is replaced).
    const auto fp = tier::memory_fingerprint(c);
    const auto k96 = tier::block_keys(p, 32, fp, 0).back().k;
    std::vector<std::byte> good;
    REQUIRE(tc.get<0>().get(k96, good));
    auto bad = good;
    bad[bad.size() / 2] ^= std::byte{1};
    REQUIRE(tc.get<0>().put(k96, bad));
    f = tc.fetch(c, 2, p);
    CHECK(f.n_tokens == 96);
    CHECK(f.tier == 1);
    CHECK(tiertest::tier_seq_bytes(c, 2) == chain_expected(2, 96, 21));
    const auto m = tc.metrics();
    CHECK(m.tiers[0].refused_for(tier::refusal::corrupt) == 1);
    CHECK(m.fetch_hits == 3);
    CHECK(m.hit_tokens == 3 * 96);
    std::vector<std::byte> now;
    REQUIRE(tc.get<0>().get(k96, now));
    CHECK(now == good);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("tier_cache: admission on the second sighting, write-back with flush") {
    const std::string dir = tiertest::tier_scratch_dir("policy");
    const prompt_tokens p = tiertest::tier_prompt(64, 2);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 64, 2);
    chain2 tc({.block_tokens = 32, .admit = tier::admission::second_sighting, .write = tier::write_mode::write_back},
              tier::memory_tier(), tier::disk_tier(dir, {.sync = false}));
    const auto k = tier::block_keys(p, 32, tier::memory_fingerprint(c), 0).back().k;
    CHECK_FALSE(tc.publish(c, 0, p).stored);
    CHECK(tc.metrics().admission_skipped == 1);
    CHECK_FALSE(tc.get<0>().contains(k));
    CHECK(tc.publish(c, 0, p).stored);
    CHECK(tc.get<0>().contains(k));
    CHECK_FALSE(tc.get<1>().contains(k));  // write-back: not yet
    CHECK(tc.flush() == 1);
    CHECK(tc.get<1>().contains(k));
    CHECK(tc.flush() == 0);
    tiertest::tier_remove_dir(dir);
}

TEST_CASE("tier_cache: a prompt with media; max_tokens inside a chunk keeps none of it") {
    prompt_tokens p;
    for (int i = 0; i < 40; ++i) p.push_back(i);
    p.push_media(77, 20);  // positions [40, 60)
    while (p.size() < 80) p.push_back(3);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 80, 6);
    tier::tier_cache<tiertest::tier_kv, tier::memory_tier> tc({.block_tokens = 16}, tier::memory_tier());
    CHECK(tc.publish(c, 0, p).key_tokens == 80);
    CHECK(tc.fetch(c, 1, p).n_tokens == 80);
    REQUIRE(c.seq_rm(1, -1, -1));
    // Keys at 16, 32, 64, 80 (48 is inside the chunk). The cap decides what is kept.
    CHECK(tc.fetch(c, 1, p, 0, 79).n_tokens == 79);
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.fetch(c, 1, p, 0, 50).n_tokens == 40);  // inside the chunk: back to its start
    CHECK(c.seq_pos_max(1) == 39);
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.fetch(c, 1, p, 0, 30).n_tokens == 30);
    REQUIRE(c.seq_rm(1, -1, -1));
    CHECK(tc.fetch(c, 1, p, 0, 0).n_tokens == 0);
    CHECK(c.seq_pos_max(1) < 0);
    // Another media id at the same place: a different key, a miss.
    prompt_tokens q;
    for (int i = 0; i < 40; ++i) q.push_back(i);
    q.push_media(78, 20);
    while (q.size() < 80) q.push_back(3);
    CHECK(tc.fetch(c, 1, q).n_tokens == 0);
}

TEST_CASE("tier_cache: misses leave the memory unchanged; bad arguments throw") {
    const prompt_tokens p = tiertest::tier_prompt(64, 9);
    tiertest::tier_kv c(tiertest::tier_shape());
    tiertest::tier_fill(c, 0, 64, 9);
    tier::tier_cache<tiertest::tier_kv, tier::memory_tier> tc({.block_tokens = 16}, tier::memory_tier());
    const auto before = io::save_state(c);
    CHECK(tc.fetch(c, 1, p).n_tokens == 0);
    CHECK(io::save_state(c) == before);
    CHECK(tc.metrics().tiers[0].misses == 4);  // 64, 48, 32, 16
    CHECK(tc.publish(c, 0, tiertest::tier_prompt(64, 9)).stored);
    prompt_tokens short_p = tiertest::tier_prompt(10, 9);
    tiertest::tier_kv s(tiertest::tier_shape());
    tiertest::tier_fill(s, 0, 10, 9);
    CHECK(tc.publish(s, 0, short_p).key_tokens == 0);
    CHECK(tc.metrics().too_short == 1);
    CHECK_THROWS_AS(static_cast<void>(tc.publish(c, 0, short_p)), kvcache::error);  // seq holds 64 positions
    CHECK_THROWS_AS(static_cast<void>(tc.fetch(c, 0, p)), kvcache::error);          // dst not empty
    using one = tier::tier_cache<tiertest::tier_kv, tier::memory_tier>;
    CHECK_THROWS_AS(one({.block_tokens = 0}, tier::memory_tier()), kvcache::error);
    // No room for the loaded entry: a load refusal, counted, nothing changed.
    tiertest::tier_kv small([] {
        auto sh = tiertest::tier_shape();
        sh.n_cells = 32;
        return sh;
    }());
    const auto empty = io::save_state(small);
    CHECK(tc.fetch(small, 0, p).n_tokens == 0);
    CHECK(tc.metrics().tiers[0].refused_for(tier::refusal::load) >= 1);
    CHECK(io::save_state(small) == empty);
    const std::pair<std::string, std::string> lab[] = {{"model", "toy"}};
    const std::string text = tier::to_prometheus(tc.metrics(), "svc", lab);
    CHECK(text.find("svc_tier_misses_total{model=\"toy\",tier=\"memory\"} " + std::to_string(tc.metrics().tiers[0].misses) +
                    "\n") != std::string::npos);
    CHECK(tc.metrics().tiers[0].misses == 7);  // 4, then 48, 32, 16 after the refused 64
    CHECK(text.find("svc_tier_fetch_hits_total{model=\"toy\"} 0\n") != std::string::npos);
    CHECK(text.find("# TYPE svc_tier_bytes gauge\n") != std::string::npos);
    CHECK_THROWS_AS(static_cast<void>(tier::to_prometheus(tc.metrics(), "9x")), kvcache::error);
    const std::pair<std::string, std::string> badlab[] = {{"a b", "x"}};
    CHECK_THROWS_AS(static_cast<void>(tier::to_prometheus(tc.metrics(), "svc", badlab)), kvcache::error);
}
}

TEST_SUITE("tier_cache") {
TEST_CASE("tier_cache under slot_manager: publish on release, fetch_longer after prepare in a fresh process") {
    const std::string dir = tiertest::tier_scratch_dir("slots");
    using one_disk = tier::tier_cache<tiertest::tier_kv, tier::disk_tier>;
    const prompt_tokens req = tiertest::tier_prompt(80, 44);
    {  // "Process A": computes the request, publishes it before releasing the slot.
        tiertest::tier_kv a(tiertest::tier_shape());
        slot_manager<tiertest::tier_kv> slots(a, {.n_slots = 2});
        one_disk tc({.block_tokens = 32}, tier::disk_tier(dir, {.sync = false}));
        const auto p = slots.prepare(req).value();
        CHECK(p.n_past == 0);
        tiertest::tier_fill(a, p.seq, 80, 44, p.n_past);
        slots.commit_prompt(p.slot);
        CHECK(tc.publish(a, p.seq, slots.tokens(p.slot)).stored);
        slots.release(p.slot);
    }
    // "Process B": a fresh cache and slot manager; the slot has nothing, the disk has 79.
    tiertest::tier_kv b(tiertest::tier_shape());
    slot_manager<tiertest::tier_kv> slots(b, {.n_slots = 2});
    one_disk tc({.block_tokens = 32}, tier::disk_tier(dir, {.sync = false}));
    const auto p = slots.prepare(req).value();
    REQUIRE(p.n_past == 0);
    const std::uint32_t n = tc.fetch_longer(b, p.seq, p.n_past, req, 3, 0, req.size() - 1);
    CHECK(n == 79);  // the last position is computed (its logits are needed)
    CHECK(b.seq_pos_max(3) < 0);
    tiertest::tier_fill(b, p.seq, 80, 44, n);
    slots.commit_prompt(p.slot);
    tiertest::tier_kv ref(tiertest::tier_shape());
    tiertest::tier_fill(ref, p.seq, 80, 44);
    CHECK(tiertest::tier_seq_bytes(b, p.seq) == tiertest::tier_seq_bytes(ref, p.seq));
    slots.release(p.slot);
    // reuse::none (the cache's policy) keeps nothing of the slot: the tiers serve again.
    const auto q = slots.prepare(req).value();
    CHECK(q.n_past == 0);
    CHECK(tc.fetch_longer(b, q.seq, q.n_past, req, 3, 0, req.size() - 1) == 79);
    CHECK(b.seq_pos_max(q.seq) == 78);
    // Nothing longer than what the sequence holds: it keeps its positions.
    CHECK(tc.fetch_longer(b, q.seq, 79, req, 3, 0, 60) == 79);
    CHECK(b.seq_pos_max(q.seq) == 78);
    CHECK_THROWS_AS(static_cast<void>(tc.fetch_longer(b, q.seq, 5, req, 3)), kvcache::error);
    tiertest::tier_remove_dir(dir);
}
}
